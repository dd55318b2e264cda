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
