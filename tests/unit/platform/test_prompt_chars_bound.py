"""A prompt text longer than the context could hold whatever its tokens is refused before it is tokenized: the
server's one tokenizer thread serves every tenant ahead of the rate limits, so a 10 MB prompt held them all."""

from __future__ import annotations

import time

import pytest

from tests.tiny_app import tiny_app_client


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model):
    with tiny_app_client(tmp_path_factory.mktemp("chars"), tiny_model, timeout=120) as (client, model_id, app):
        yield client, model_id, app



@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_a_prompt_too_long_for_any_tokenization_is_refused_untokenized(server, endpoint, monkeypatch):
    client, model_id, app = server
    engine = app.state.services.engine
    calls = []
    for name in ("encode", "apply_chat_template"):
        original = getattr(engine, name)
        monkeypatch.setattr(engine, name, lambda *a, _o=original, **k: (calls.append(1), _o(*a, **k))[1])
    text = "hello world, the quick brown fox. " * 120_000  # 4 MB
    body = ({"prompt": text} if endpoint == "completions"
            else {"messages": [{"role": "user", "content": text}]})
    started = time.monotonic()
    r = client.post(f"/v1/{'chat/' if endpoint == 'chat' else ''}completions",
                    json={"model": model_id, "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded"
    assert err["param"] == ("prompt" if endpoint == "completions" else "messages")
    assert calls == [], "the prompt was tokenized"
    assert time.monotonic() - started < 3


def test_a_prompt_that_fits_still_runs(server):
    client, model_id, _ = server
    r = client.post("/v1/completions", json={"model": model_id, "prompt": "hello world", "max_tokens": 2})
    assert r.status_code == 200, r.text
    r = client.post("/v1/chat/completions", json={"model": model_id, "max_tokens": 2,
                                                  "messages": [{"role": "user", "content": "hello"}]})
    assert r.status_code == 200, r.text
