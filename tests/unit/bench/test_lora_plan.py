"""bench lora_plan: the mixes it replays and its smoke run (interpreter) writing a row per plan and covered mix."""

from __future__ import annotations

import json

import torch

from loraplex.bench import lora_plan


def test_zipf_slots_are_seeded_skewed_and_numbered_by_first_appearance():
    slots = lora_plan.zipf_slots(248, seed=0)
    assert torch.equal(slots, lora_plan.zipf_slots(248, seed=0))
    distinct = slots.unique()
    assert distinct.tolist() == list(range(len(distinct)))  # slots 0..n-1
    first = [int(s) for s in slots]
    assert [s for i, s in enumerate(first) if s not in first[:i]] == sorted(set(first))  # in order of appearance
    counts = torch.bincount(slots.long())
    assert 20 < len(distinct) < 100 and int(counts.max()) > 248 // 5  # a head adapter and a long tail


def test_mixes_pad_the_bucket_with_base_rows():
    for name, slots in lora_plan.mixes_for(16, 12):
        assert slots.shape == (16,) and (slots[12:] == -1).all() and (slots[:12] >= 0).all(), name


def test_smoke_run_writes_a_row_per_plan_and_covered_mix_and_silu_path(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    out = tmp_path / "plan.json"
    assert lora_plan.main(["--smoke", "--tokens", "8", "--real", "6", "--plans", "2,99", "--reps", "1",
                           "--no-profile", "--silu", "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    rows = payload["plan"]["rows"]
    assert [r["path"] for r in payload["silu"]] == (["base GEMM + silu_mul"] + ["expand, then silu_mul"] * 5
                                                    + ["delta inside silu_mul"] * 5)
    assert [r["plan"] for r in rows] == ["graph"] * 5 + ["<= 2"]  # 99 is above the graph's plan: no variant
    assert rows[-1]["mix"] == "1 adapter" and rows[-1]["max_chunks"] < rows[0]["max_chunks"]
    assert "| 1 adapter | 1 | <= 2 |" in out.with_suffix(".md").read_text()


def test_prompt_mixes_give_each_request_one_adapter():
    for name, slots in lora_plan.prompt_mixes(100, 16):
        assert slots.shape == (100,) and slots.dtype == torch.int32, name
        requests = [slots[i:i + 16] for i in range(0, 100, 16)]
        assert all((r == r[0]).all() for r in requests), name  # one adapter per request
        used = torch.unique(slots)
        assert used.tolist() == list(range(len(used))), name  # dense slots 0..n-1
    counts = {name: len(torch.unique(s)) for name, s in lora_plan.prompt_mixes(100, 16)}
    assert counts["distinct"] == 7 and counts["1 adapter"] == 1 and counts["8 adapters"] <= 7


def test_smoke_silu_prompt_rows(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    out = tmp_path / "plan.json"
    assert lora_plan.main(["--smoke", "--tokens", "8", "--plans", "", "--reps", "1", "--no-profile",
                           "--silu-prompt", "40", "--prompt-len", "16", "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    paths = [r["path"] for r in payload["silu_prompt"]]
    assert paths == ["base GEMM + silu_mul"] + ["default order, then silu_mul", "delta inside silu_mul"] * 5
    assert all(r["time_ms"] > 0 and r["tokens"] == 40 for r in payload["silu_prompt"])
    assert "in a prompt step of 40 tokens, requests of 16" in out.with_suffix(".md").read_text()
