"""``loraplex batch``: JSONL in, JSONL out in the same order, a bad line reported without stopping."""

from __future__ import annotations

import json

from loraplex import LLM, SamplingParams
from loraplex.cli import main


def test_batch_command_writes_one_line_per_input(tiny_model, tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [
        {"id": "a", "prompt": "The river runs", "params": {"max_tokens": 6, "ignore_eos": True}},
        {"id": "b", "prompt_token_ids": [1, 40, 41, 42], "params": {"n": 2, "temperature": 1.0, "seed": 3}},
        {"id": "c", "params": {"max_tokens": 3}},
        {"id": "d", "prompt": "Hello", "params": {"top_p": 7}},
    ]
    src.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    rc = main(["batch", str(src), str(dst), "--model", tiny_model["model_dir"], "--dtype", "float32",
               "--max-tokens", "4"])
    out = [json.loads(x) for x in dst.read_text().splitlines()]
    assert rc == 1  # two lines failed
    assert [o["id"] for o in out] == ["a", "b", "c", "d"]
    want = LLM(tiny_model["model_dir"], dtype="float32").generate(
        "The river runs", SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0].outputs[0]
    assert out[0]["outputs"][0]["token_ids"] == want.token_ids and out[0]["outputs"][0]["text"] == want.text
    assert [c["index"] for c in out[1]["outputs"]] == [0, 1]
    assert all(len(c["token_ids"]) <= 4 for c in out[1]["outputs"])
    assert "prompt" in out[2]["error"] and "top_p" in out[3]["error"]


def test_lines_the_engine_refuses_fail_alone(tiny_model, tmp_path):
    """A prompt over max_model_len, a token id outside the vocabulary or a line that is not UTF-8 is an error
    on its own output line; the other lines of the same chunk still run (they used to crash the command)."""
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    good = {"id": "ok", "prompt_token_ids": [1, 40, 41, 42], "params": {"ignore_eos": True}}
    lines = [
        json.dumps(good).encode(),
        json.dumps({"id": "long", "prompt_token_ids": [5] * 200}).encode(),
        json.dumps({"id": "vocab", "prompt_token_ids": [5, 10**6]}).encode(),
        b'{"id": "bytes", "prompt": "\xff\xfe"}',
        json.dumps({**good, "id": "ok2"}).encode(),
    ]
    src.write_bytes(b"\n".join(lines) + b"\n")
    rc = main(["batch", str(src), str(dst), "--model", tiny_model["model_dir"], "--dtype", "float32",
               "--max-tokens", "3", "--max-model-len", "64"])
    out = [json.loads(x) for x in dst.read_text().splitlines()]
    assert rc == 1
    assert [o["id"] for o in out] == ["ok", "long", "vocab", "3", "ok2"]
    assert "max_model_len 64" in out[1]["error"] and "[0, 512)" in out[2]["error"]
    assert "UTF-8" in out[3]["error"]
    want = LLM(tiny_model["model_dir"], dtype="float32").generate(
        {"prompt_token_ids": [1, 40, 41, 42]}, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert out[0]["outputs"][0]["token_ids"] == out[4]["outputs"][0]["token_ids"] == want[0].outputs[0].token_ids
