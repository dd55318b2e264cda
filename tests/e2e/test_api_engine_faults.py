"""Engine faults seen from a real client on a real port: the app runs under uvicorn in this process
(so the test can reach into the real engine): a client disconnect aborts the engine request within a
second; an engine that dies ends in-flight streams with an error event, /ready turns 503, and new
requests get a fast 503 (nothing hangs)."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from tests.e2e.server import free_port
from tests.tiny_app import tiny_app


@pytest.fixture(scope="module")
def live(tmp_path_factory, tiny_model):
    import uvicorn

    app, engine, keys, model = tiny_app(tmp_path_factory.mktemp("faults"), tiny_model, num_kv_blocks=256)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while not keys or httpx.get(base + "/ready").status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {keys[0]}"}) as c:
        c.post("/admin/tenants", json={"name": "faulty"}).raise_for_status()
        key = c.post("/admin/keys", json={"tenant": "faulty"}).json()["key"]
    yield {"base": base, "key": key, "engine": engine, "app": app, "model": model}
    server.should_exit = True
    thread.join(30)


def test_disconnect_aborts_engine_request_within_a_second(live):
    engine = live["engine"]
    body = {"model": live["model"], "prompt": "go", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=live["base"], headers={"Authorization": f"Bearer {live['key']}"}) as c, \
            c.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        next(lines)
        assert engine.engine.has_unfinished_requests()
    t0 = time.monotonic()
    while engine.engine.has_unfinished_requests():
        assert time.monotonic() - t0 < 1.0, "engine still runs the request 1 s after the client left"
        time.sleep(0.02)


def test_non_streaming_disconnect_aborts_too(live):
    engine = live["engine"]
    body = {"model": live["model"], "prompt": "go", "max_tokens": 2000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(live["base"] + "/v1/completions", json=body, timeout=0.5,
                   headers={"Authorization": f"Bearer {live['key']}"})
    t0 = time.monotonic()
    while engine.engine.has_unfinished_requests():
        assert time.monotonic() - t0 < 1.0, "engine still runs the request 1 s after the client left"
        time.sleep(0.02)


def test_engine_death_ends_streams_with_an_error_and_fails_ready(live):
    engine = live["engine"]
    client = openai.OpenAI(api_key=live["key"], base_url=live["base"] + "/v1", max_retries=0, timeout=30)
    stream = client.completions.create(model=live["model"], prompt="go", max_tokens=2000, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))

    def broken_step():
        raise RuntimeError("simulated device fault")

    engine.engine.step = broken_step  # the engine loop thread dies on its next step
    t0 = time.monotonic()
    with pytest.raises(openai.APIError) as err:
        for _ in stream:
            pass
    assert time.monotonic() - t0 < 5, "the stream hung after the engine died"
    assert "engine" in str(err.value).lower()
    r = httpx.get(live["base"] + "/ready")
    assert r.status_code == 503 and r.json()["status"] == "engine_dead"
    assert httpx.get(live["base"] + "/health").status_code == 200  # liveness stays up
    t0 = time.monotonic()
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(model=live["model"], prompt="x", max_tokens=2)
    assert err.value.status_code == 503 and time.monotonic() - t0 < 2
    assert err.value.response.headers["retry-after"]
