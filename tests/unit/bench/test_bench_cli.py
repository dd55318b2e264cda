"""``loraplex bench attention|offline --smoke`` end to end on the CPU: real engine, real kernels (interpreter)."""

from __future__ import annotations

import json

from loraplex.cli import main


def _report(out_dir, name):
    (json_path,) = out_dir.glob(f"{name}-*.json")
    (md_path,) = out_dir.glob(f"{name}-*.md")
    return json.loads(json_path.read_text()), md_path.read_text()


def test_bench_attention_smoke_agrees_with_sdpa(tmp_path):
    assert main(["bench", "attention", "--smoke", "--out-dir", str(tmp_path)]) == 0
    data, md = _report(tmp_path, "attention")
    assert data["command"] == f"loraplex bench attention --out-dir {tmp_path} --smoke"
    assert [r["context"] for r in data["decode"]] == [37, 100]
    assert all(r["max_abs_err_vs_sdpa"] < 1e-4 for r in data["decode"] + data["prefill"])
    assert "SDPA" in md and data["command"] in md


def test_bench_offline_smoke_with_peer(tmp_path):
    work = tmp_path / "work"
    out = tmp_path / "out"
    rc = main(["bench", "offline", "--smoke", "--peer", "hf-peft", "--work-dir", str(work), "--out-dir", str(out)])
    assert rc == 0
    data, md = _report(out, "offline")
    assert data["command"] == f"loraplex bench offline --out-dir {out} --smoke --work-dir {work} --peer hf-peft"
    rows = {r["popularity"]: r for r in data["throughput"]}
    assert list(rows) == ["base", "identical", "zipf", "uniform", "distinct"]
    assert all(r["output_tokens"] == r["num_requests"] * 4 for r in rows.values())  # ignore_eos honoured
    assert rows["distinct"]["num_adapters"] == rows["distinct"]["num_requests"]
    assert rows["base"]["over_base"] == 1.0
    steps = data["decode_step"]
    assert [s["num_adapters"] for s in steps] == [0, 3] and steps[1]["roofline"]["lora"] > 0
    assert data["peer"]["output_tokens"] == 2 * 4
    for title in ("Offline throughput", "Decode step vs HBM roofline", "Peer: Hugging Face"):
        assert title in md


def test_bench_all_smoke_puts_every_target_in_one_report(tmp_path):
    out = tmp_path / "out"
    rc = main(["bench", "all", "--smoke", "--skip-lora-kernels", "--popularity", "base,distinct", "--peer", "none",
               "--work-dir", str(tmp_path / "work"), "--out-dir", str(out)])
    assert rc == 0
    data, md = _report(out, "issue9")
    assert set(data) >= {"attention", "offline", "command", "environment"}
    targets = md.split("## Targets (issue 9)")[1].split("\n## ")[0]
    for name in ("decode step ÷ HBM floor (batch 3, context ~16)", "multi-LoRA ÷ base throughput, distinct",
                 "paged decode attention speed ÷ SDPA"):
        assert name in targets
    assert "HF + PEFT" not in targets  # the peer was switched off: no figure is invented for it
