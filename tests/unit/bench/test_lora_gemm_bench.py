"""The fused-GEMM benchmark on the CPU (interpreter, tiny shapes; timings meaningless): every projection gets its
cuBLAS-stand-in, usual-path, Triton-GEMM and fused rows at both step sizes, the fastest fused configuration is kept
per (shape, step size), and the fused path's error against fp32 is reported."""

from __future__ import annotations

import json
import os

os.environ["TRITON_INTERPRET"] = "1"

from loraplex.bench import lora_gemm  # noqa: E402


def test_smoke_run_reports_every_projection_and_keeps_the_fastest_configuration(tmp_path):
    out = tmp_path / "lg.json"
    assert lora_gemm.main(["--smoke", "--no-in-layer", "--reps", "1", "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    projs = payload["projections"]
    assert [(p["tokens"], p["proj"]) for p in projs] == [(t, p) for t in (8, 12) for p in ("qkv", "o", "gate_up", "down")]
    for p in projs:
        variants = {r["variant"] for r in p["rows"]}
        assert variants == {"cuBLAS", "cuBLAS + shrink + expand", "Triton GEMM", "shrink + fused GEMM",
                            "shrink, then fused GEMM (no overlap)"}, variants
        fused = min(r["us_per_layer"] for r in p["rows"] if r["variant"] == "shrink + fused GEMM")
        assert p["fused_us"] == fused and p["best_fused"] is not None
        assert p["errors"]["fused"]["max_abs"] < 1e-4  # fp32 on the CPU
    assert len(payload["tuned_blocks"]) == 4  # one per shape: 8 and 12 tokens are both "small" steps
    md = out.with_suffix(".md").read_text()
    assert "| 12 | gate_up |" in md and "shrink + fused GEMM" in md
