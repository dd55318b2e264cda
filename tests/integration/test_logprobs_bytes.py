"""Logprobs of tokens that hold part of a UTF-8 character keep their identity, as OpenAI's do: chat's ``bytes`` are the
token's own bytes (a client joins them into the text), not those of "\ufffd"; /v1/completions names such a token
``bytes:\\xe2\\x80`` so that its ``top_logprobs`` keep one key per candidate. The app runs in-process (embedded)
with the tiny model on the CPU, whose random weights propose many partial-character tokens (its byte-level
vocabulary splits every non-ASCII character); streamed answers carry the same logprobs."""

from __future__ import annotations

import json

import pytest

from loraplex.engine.token_bytes import escape_bytes
from tests.integration.usage_app import usage_app

TOP = 20
REPLACEMENT = list("\ufffd".encode())


@pytest.fixture
async def app(tmp_path, tiny_model):
    async with usage_app(tmp_path, model=tiny_model["model_dir"], max_model_len=256, num_kv_blocks=64) as ua:
        key = (await ua.tenant("acme"))["key"]
        model = (await ua.client.get("/v1/models", headers=ua.headers(key))).json()["data"][0]["id"]
        yield ua, ua.headers(key), model


def _events(text: str) -> list[dict]:
    lines = [line.removeprefix("data: ") for line in text.split("\n\n") if line.startswith("data: ")]
    return [json.loads(line) for line in lines if line != "[DONE]"]


async def test_completion_top_logprobs_keep_a_key_per_candidate(app):
    ua, headers, model = app
    body = {"model": model, "prompt": "Once", "max_tokens": 24, "temperature": 1.5, "seed": 3, "logprobs": TOP,
            "ignore_eos": True}
    r = await ua.client.post("/v1/completions", json=body, headers=headers)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    for k, top in enumerate(lp["top_logprobs"]):
        # the N most likely, plus the sampled token when it is not among them: none collapse into one key
        assert len(top) in (TOP, TOP + 1), (k, top)
        assert lp["tokens"][k] in top
    named = {t for top in lp["top_logprobs"] for t in top if t.startswith("bytes:")}
    assert len(named) > 1 and not any("\ufffd" in t for top in lp["top_logprobs"] for t in top)
    assert all(len(t) > len("bytes:") and t.isascii() for t in named)
    offsets = lp["text_offset"]
    assert all(offsets[k] == offsets[k - 1] + len(lp["tokens"][k - 1]) for k in range(1, len(offsets)))

    r = await ua.client.post("/v1/completions", json={**body, "stream": True}, headers=headers)
    parts = [c["choices"][0]["logprobs"] for c in _events(r.text) if c["choices"] and c["choices"][0]["logprobs"]]
    streamed = {field: [x for part in parts for x in part[field]] for field in lp}
    assert streamed == lp


async def test_chat_logprobs_carry_each_tokens_own_bytes(app, tiny_model):
    from transformers import AutoTokenizer

    specials = set(AutoTokenizer.from_pretrained(tiny_model["model_dir"]).all_special_tokens)
    ua, headers, model = app
    body = {"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 24,
            "temperature": 1.5, "seed": 3, "logprobs": True, "top_logprobs": TOP, "ignore_eos": True}
    r = await ua.client.post("/v1/chat/completions", json=body, headers=headers)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == 24
    for entry in content:
        top = entry["top_logprobs"]
        assert len(top) == TOP and len({tuple(t["bytes"]) for t in top}) == TOP  # distinct candidates, distinct bytes
        for e in [entry, *top]:
            raw = bytes(e["bytes"])
            assert list(raw) != REPLACEMENT, e
            try:
                assert e["token"] == raw.decode() or e["token"] in specials, e
            except UnicodeDecodeError:  # part of a character: the token shows its bytes escaped
                assert e["token"] == escape_bytes(raw), e
    assert any(e["token"].startswith("\\x") for e in content), "the random model samples partial characters"
    # the sampled tokens' bytes are the answer's bytes (special tokens are skipped from the text; a character the
    # last tokens leave unfinished is not sent)
    rebuilt = b"".join(bytes(e["bytes"]) for e in content if e["token"] not in specials).decode(errors="replace")
    text = choice["message"]["content"]
    assert rebuilt.startswith(text) and set(rebuilt[len(text):]) <= {"\ufffd"}, (rebuilt, text)

    r = await ua.client.post("/v1/chat/completions", json={**body, "stream": True}, headers=headers)
    streamed = [e for c in _events(r.text) if c["choices"] and c["choices"][0].get("logprobs")
                for e in c["choices"][0]["logprobs"]["content"]]
    assert streamed == content
