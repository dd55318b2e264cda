"""``Idempotency-Key`` against a live server (SECURITY.md 26): an identical retry replays the first answer
without running or billing again, a different body is 422, a concurrent reuse is 409, tenants never share keys,
and a retried upload creates one adapter version."""

from __future__ import annotations

import threading
import time
import uuid

import httpx
import pytest

from tests.e2e.server import BACKENDS, backend_server
from tests.e2e.test_api_openai import _adapter_dir, _usage_totals, base_model


@pytest.fixture(scope="module", params=BACKENDS)
def server(request, tmp_path_factory):
    with backend_server(request, tmp_path_factory, request.param) as srv:
        yield srv


@pytest.fixture(scope="module")
def tenant(server):
    return server.create_tenant("idem-co", scopes=["inference", "adapters:write"])


def _client(server, key: str) -> httpx.Client:
    return httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def _wait_for_requests(server, key: str, at_least: int) -> dict:
    deadline = time.monotonic() + 15
    while (totals := _usage_totals(server, key))["requests"] < at_least:
        assert time.monotonic() < deadline, totals
        time.sleep(0.1)
    return totals


def test_identical_retry_replays_without_billing_and_different_body_is_422(server, tenant):
    key = tenant["key"]
    body = {"model": base_model(server), "prompt": "Once upon a time", "max_tokens": 5, "temperature": 1.0}
    before = _usage_totals(server, key)
    with _client(server, key) as c:
        first = c.post("/v1/completions", json=body, headers={"Idempotency-Key": "order-1"})
        assert first.status_code == 200, first.text
        assert "idempotent-replayed" not in first.headers
        _wait_for_requests(server, key, before["requests"] + 1)
        # same body, other key order: the same request
        again = c.post("/v1/completions", json=dict(reversed(body.items())), headers={"Idempotency-Key": "order-1"})
        assert again.status_code == 200 and again.headers["idempotent-replayed"] == "true"
        assert again.json() == first.json()  # same id, text and usage numbers

        changed = c.post("/v1/completions", json={**body, "max_tokens": 6}, headers={"Idempotency-Key": "order-1"})
        assert changed.status_code == 422 and changed.json()["error"]["code"] == "idempotency_key_reused"
        assert changed.json()["error"]["param"] == "Idempotency-Key"
        chat = c.post("/v1/chat/completions", headers={"Idempotency-Key": "order-1"},
                      json={"model": body["model"], "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert chat.status_code == 200 and "idempotent-replayed" not in chat.headers  # another route, another key

        for bad in ("", "x" * 256):
            r = c.post("/v1/completions", json=body, headers={"Idempotency-Key": bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == "Idempotency-Key"
    # one billed completion and one chat: the replay and the refusals cost nothing
    after = _wait_for_requests(server, key, before["requests"] + 2)
    time.sleep(0.5)
    after = _usage_totals(server, key)
    assert after["requests"] == before["requests"] + 2
    usage = first.json()["usage"]
    assert after["completion_tokens"] == (before["completion_tokens"] + usage["completion_tokens"]
                                          + chat.json()["usage"]["completion_tokens"])


def test_concurrent_reuse_gives_one_200_and_one_409(server, tenant):
    body = {"model": base_model(server), "prompt": "Tell a long story about a lantern keeper",
            "max_tokens": 120, "temperature": 1.0}
    key_value = f"concurrent-{uuid.uuid4()}"
    barrier = threading.Barrier(2)
    results: list[httpx.Response] = []

    def call() -> None:
        with _client(server, tenant["key"]) as c:
            barrier.wait()
            results.append(c.post("/v1/completions", json=body, headers={"Idempotency-Key": key_value}))

    threads = [threading.Thread(target=call) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    by_status = sorted(results, key=lambda r: r.status_code)
    assert [r.status_code for r in by_status] == [200, 409], [r.text for r in results]
    assert by_status[1].json()["error"]["code"] == "idempotency_key_in_use"
    assert "idempotent-replayed" not in by_status[0].headers


def test_another_tenant_with_the_same_key_value_is_independent(server, tenant):
    other = server.create_tenant("idem-other", scopes=["inference"])
    model = base_model(server)
    with _client(server, tenant["key"]) as a, _client(server, other["key"]) as b:
        mine = a.post("/v1/chat/completions", headers={"Idempotency-Key": "shared-value"},
                      json={"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3})
        theirs = b.post("/v1/chat/completions", headers={"Idempotency-Key": "shared-value"},
                        json={"model": model, "messages": [{"role": "user", "content": "other"}], "max_tokens": 4})
    assert mine.status_code == theirs.status_code == 200
    assert "idempotent-replayed" not in theirs.headers and theirs.json()["id"] != mine.json()["id"]


def test_a_started_stream_is_not_replayed(server, tenant):
    body = {"model": base_model(server), "prompt": "abc", "max_tokens": 3, "stream": True}
    with _client(server, tenant["key"]) as c:
        first = c.post("/v1/completions", json=body, headers={"Idempotency-Key": "stream-1"})
        assert first.status_code == 200 and first.text.rstrip().endswith("data: [DONE]")
        again = c.post("/v1/completions", json=body, headers={"Idempotency-Key": "stream-1"})
    assert again.status_code == 409 and again.json()["error"]["code"] == "idempotent_replay_unavailable"


def test_retried_upload_gives_the_same_adapter_version(server, tenant):
    src = _adapter_dir(server)
    files = {"config": ("adapter_config.json", (src / "adapter_config.json").read_bytes()),
             "weights": ("adapter_model.safetensors", (src / "adapter_model.safetensors").read_bytes())}
    with _client(server, tenant["key"]) as c:
        # a retry sends the same bytes again (multipart boundary included)
        built = c.build_request("POST", "/v1/adapters", data={"name": "idem-tune"}, files=files)
        raw, headers = built.read(), {"Idempotency-Key": "up-1", "Content-Type": built.headers["content-type"]}
        first = c.post("/v1/adapters", content=raw, headers=headers)
        assert first.status_code == 201, first.text
        assert "idempotent-replayed" not in first.headers
        again = c.post("/v1/adapters", content=raw, headers=headers)
        assert again.status_code == 201 and again.headers["idempotent-replayed"] == "true"
        assert again.json() == first.json()
        other = c.post("/v1/adapters", data={"name": "idem-tune", "description": "changed"}, files=files,
                       headers={"Idempotency-Key": "up-1"})
        assert other.status_code == 422 and other.json()["error"]["code"] == "idempotency_key_reused"
        versions = c.get("/v1/adapters/idem-tune").json()["versions"]
    assert len(versions) == 1
