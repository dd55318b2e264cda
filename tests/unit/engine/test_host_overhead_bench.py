"""``loraplex bench host-overhead`` runs the real host path of decode steps and writes its report."""

from __future__ import annotations

import json

from loraplex.bench.host_overhead import PHASES, run_host_overhead
from loraplex.cli import main


def test_every_timed_step_decodes_every_request(tiny_model):
    result = run_host_overhead(num_requests=24, context=40, steps=20, warmup=2, block_size=4,
                               tokenizer=tiny_model["model_dir"])
    assert result["detokenize"] is True
    phases = result["phases_us"]
    assert set(phases) == {*PHASES, "total"}
    assert all(phases[p]["median_us"] > 0 for p in PHASES)
    assert phases["total"]["median_us"] >= max(phases[p]["median_us"] for p in PHASES)
    # one new block every 4 decode steps per sequence: about a quarter of the rows are rewritten per step
    assert 24 / 4 * 0.5 <= result["block_table_row_writes_per_step"] <= 24 / 4 * 1.5


def test_cli_writes_markdown_and_json(tmp_path):
    out = tmp_path / "host.md"
    assert main(["bench", "host-overhead", "--smoke", "--sampling", "penalties", "--out", str(out)]) == 0
    text = out.read_text()
    assert "loraplex bench host-overhead" in text and "| **total** |" in text
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["sampling"] == "penalties" and data["graph_padding"] is True
