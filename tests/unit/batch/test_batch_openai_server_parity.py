"""An OpenAI-format batch line gets the answer the server gives its body: the same status, error (message, type,
param, code) and, for a greedy request, the same choices (text, logprobs, finish reason) and usage. Each body below goes to a real server app (the
tiny model's engine, in-process) and into one batch file; the SDK fields, limits, defaults and refusals are the
ones users met in review (metadata, store, service_tier, temperature above 2, NaN, max_tokens without a cap, ...)."""

from __future__ import annotations

import json
import math

import pytest

from loraplex.engine.config import served_model_id
from tests.tiny_app import tiny_app_client
from tests.unit.batch.test_batch_cli import _run, _write_jsonl

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
HI = [{"role": "user", "content": "Hello"}]

# (url, body without model): each one the server refuses, or runs greedily
BODIES = [
    # SDK fields the server takes unread, or with their no-op value
    (CHAT, {"messages": HI, "max_completion_tokens": 4, "temperature": 0, "metadata": {"job": "a"}, "store": False,
            "user": "u-1", "service_tier": "auto", "parallel_tool_calls": False, "safety_identifier": "s",
            "prompt_cache_key": "k", "modalities": ["text"], "response_format": {"type": "text"}}),
    (CHAT, {"messages": HI, "max_tokens": 3, "temperature": 0, "tool_choice": "none",
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}),
    (CHAT, {"messages": [{"role": "developer", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
            "max_completion_tokens": 3, "temperature": 0, "max_tokens": 5}),
    (COMPLETIONS, {"prompt": "Once upon a time", "temperature": 0}),  # no max_tokens: 16
    (COMPLETIONS, {"prompt": [1, 40, 41], "max_tokens": 3, "temperature": 0, "stop": ["\n", "x"], "n": 2}),
    (COMPLETIONS, {"prompt": ["Hello"], "max_tokens": 2, "temperature": 0, "best_of": 1, "suffix": ""}),
    # logprobs, rendered by the server's code
    (COMPLETIONS, {"prompt": "Once upon", "max_tokens": 3, "temperature": 0, "logprobs": 2, "prompt_logprobs": 1}),
    (CHAT, {"messages": HI, "max_tokens": 3, "temperature": 0, "logprobs": True, "top_logprobs": 3,
            "prompt_logprobs": 0}),
    (CHAT, {"messages": HI, "max_tokens": 2, "temperature": 0, "logprobs": False, "top_logprobs": 0}),
    # refused as the server refuses them
    (CHAT, {"messages": HI, "store": True}),
    (CHAT, {"messages": HI, "service_tier": "flex"}),
    (CHAT, {"messages": HI, "modalities": ["text", "audio"]}),
    (CHAT, {"messages": HI, "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}),
    (CHAT, {"messages": HI, "response_format": {"type": "json_object"}}),
    (CHAT, {"messages": HI, "temperature": 2.5}),
    (CHAT, {"messages": HI, "max_completion_tokens": -1}),
    (CHAT, {"messages": HI, "max_tokens": 99999999999999999999999}),
    (CHAT, {"messages": HI, "max_tokens": 5000}),
    (CHAT, {"messages": HI, "seed": 1.5}),
    (CHAT, {"messages": HI, "n": True}),
    (CHAT, {"messages": HI, "stop": [5]}),
    (CHAT, {"messages": HI, "logit_bias": {"1": "x"}}),
    (CHAT, {"messages": [{"role": "user", "content": None}]}),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y"}}]}]}),
    (CHAT, {"messages": [{"role": "robot", "content": "x"}]}),
    (CHAT, {"messages": []}),
    (CHAT, {"messages": HI, "top_logprobs": 2}),
    (CHAT, {"messages": HI, "continue_final_message": True}),
    (CHAT, {"prompt": "no messages"}),
    (CHAT, {"messages": HI, "model": "gpt-4o-mini"}),
    (CHAT, {"messages": HI, "model": ""}),
    (COMPLETIONS, {"prompt": "Hello", "max_tokens": 4, "stop": ""}),
    (COMPLETIONS, {"prompt": "Hello", "max_tokens": 4, "stop": [str(i) for i in range(9)]}),
    (COMPLETIONS, {"prompt": "Hello", "max_tokens": 4, "stop": "x" * 257}),
    (COMPLETIONS, {"prompt": "Hello", "max_tokens": 4, "n": 0}),
    (COMPLETIONS, {"prompt": "Hello", "max_tokens": 4, "n": 200}),
    (COMPLETIONS, {"prompt": "Hello", "max_tokens": 4, "seed": 18446744073709551616}),
    (COMPLETIONS, {"prompt": "Hello", "max_tokens": 4, "min_tokens": 10}),
    (COMPLETIONS, {"prompt": "Hello", "max_tokens": 4, "logit_bias": {"5": 200}}),
    (COMPLETIONS, {"prompt": "Hello", "max_tokens": 4, "logit_bias": {"abc": 1}}),
    (COMPLETIONS, {"prompt": "Hello", "max_tokens": 4.0}),
    (COMPLETIONS, {"prompt": "Hello", "max_tokens": 0}),
    (COMPLETIONS, {"prompt": "Hello", "temperature": "0.5"}),
    (COMPLETIONS, {"prompt": "Hello", "presence_penalty": 3}),
    (COMPLETIONS, {"prompt": "Hello", "best_of": 2}),
    (COMPLETIONS, {"prompt": "Hello", "suffix": "x"}),
    (COMPLETIONS, {"prompt": "", "max_tokens": 3, "temperature": 0}),
    (COMPLETIONS, {"prompt": [1, 99999]}),
    (COMPLETIONS, {"prompt": [5] * 4100, "max_tokens": 4}),
    (COMPLETIONS, {"prompt": [5] * 4000, "max_tokens": 200}),
    (COMPLETIONS, {"prompt": "Hello", "truncate_prompt_tokens": 0}),
]


def _same(mine, theirs) -> bool:
    """Equal, logprobs within 1e-4: the server's engine and the batch's run the same model in other batches and KV
    caches, so a logprob may differ in its last float32 digits."""
    if isinstance(mine, float) and isinstance(theirs, float):
        return math.isclose(mine, theirs, abs_tol=1e-4)
    if isinstance(mine, dict) and isinstance(theirs, dict):
        return mine.keys() == theirs.keys() and all(_same(mine[k], theirs[k]) for k in mine)
    if isinstance(mine, list) and isinstance(theirs, list):
        return len(mine) == len(theirs) and all(_same(a, b) for a, b in zip(mine, theirs))
    return mine == theirs


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model):
    with tiny_app_client(tmp_path_factory.mktemp("parity"), tiny_model, timeout=60) as (client, model_id, _):
        yield client, model_id


def test_each_body_gets_the_servers_answer(server, tiny_model, tmp_path):
    client, model_id = server
    bodies = [(url, {"model": model_id, **body}) for url, body in BODIES]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(src, [{"custom_id": f"c{i}", "method": "POST", "url": url, "body": body}
                       for i, (url, body) in enumerate(bodies)])
    assert _run(tiny_model, src, dst) == 1
    out = [json.loads(x) for x in dst.read_text().splitlines()]
    assert [o["custom_id"] for o in out] == [f"c{i}" for i in range(len(bodies))]
    for (url, body), record in zip(bodies, out):
        answer = client.post(url, content=json.dumps(body), headers={"content-type": "application/json"})
        response = record["response"]
        assert record["error"] is None and response["status_code"] == answer.status_code, (body, record, answer.text)
        if answer.status_code != 200:
            assert response["body"] == answer.json(), body
            continue
        want, got = answer.json(), response["body"]
        assert (got["object"], got["model"]) == (want["object"], want["model"]), body
        assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"], body
        assert got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"], body
        assert _same(got["choices"], want["choices"]), (body, got["choices"], want["choices"])
        assert _same(got.get("prompt_logprobs"), want.get("prompt_logprobs")), body


def test_bodies_the_server_reads_as_no_json_are_lines_that_are_no_json(tiny_model, tmp_path):
    """NaN, Infinity, a lone surrogate escape (the server answers "JSON is malformed") and a number no float holds
    are no JSON: such a line fails on its own as invalid_json, its custom_id unread (a lone surrogate is no text a
    strict JSON parser of the output would take), and the lines around it run."""
    model = served_model_id(tiny_model["model_dir"])
    good = {"model": model, "prompt": [1, 40, 41], "max_tokens": 2, "temperature": 0}

    def line(custom_id: str, body_text: str) -> str:
        return (f'{{"custom_id": "{custom_id}", "method": "POST", "url": "{COMPLETIONS}", '
                f'"body": {body_text}}}')

    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(src, [line("ok-1", json.dumps(good)),
                       line("nan", json.dumps(good)[:-1] + ', "temperature": NaN}'),
                       line("inf", json.dumps(good)[:-1] + ', "top_p": Infinity}'),
                       line("lone", json.dumps({**good, "prompt": "x"})[:-1] + ', "prompt": "x\\udc80y"}'),
                       line("cid\\ud800", json.dumps(good)),
                       line("huge", json.dumps(good)[:-1] + ', "seed": 1e400}'),
                       line("ok-2", json.dumps(good))])
    assert _run(tiny_model, src, dst) == 1
    out = [json.loads(x) for x in dst.read_text().splitlines()]
    assert [o["custom_id"] for o in out] == ["ok-1", None, None, None, None, None, "ok-2"]
    for line_no, record in enumerate(out[1:6], start=2):
        assert record["response"] is None and record["error"]["code"] == "invalid_json", record
        assert record["error"]["message"].startswith(f"line {line_no} is not JSON: "), record
    assert all(": JSON is malformed: " in record["error"]["message"] for record in out[1:5])
    assert "invalid utf-16 surrogate pair" in out[3]["error"]["message"]
    assert "surrogate pair" in out[4]["error"]["message"]  # a high surrogate alone: "unexpected end of ..."
    assert "\\ud" not in dst.read_text()  # nothing a strict parser refuses
    assert out[5]["error"]["message"] == ("line 6 is not JSON: body.seed: the number is out of range: a JSON number "
                                          "must be finite and within about ±1.8e308 (a 64-bit float).")
    assert out[0]["response"]["body"]["choices"] == out[6]["response"]["body"]["choices"]
