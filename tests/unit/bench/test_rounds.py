"""Repeated rounds of the popularity list: each ratio against its own round's base, the median round reported."""

from __future__ import annotations

from loraplex.bench.offline import add_over_base, summarize_rounds
from loraplex.bench.sections import target_rows, throughput_section


def _row(pop, tok_s, round_no):
    return {"popularity": pop, "output_tok_per_s": tok_s, "round": round_no, "num_adapters": 0, "num_requests": 10,
            "prompt_tokens": 100, "output_tokens": 40, "elapsed_s": 40 / tok_s, "total_tok_per_s": 140 / tok_s}


def test_each_ratio_uses_its_own_rounds_base_and_the_median_round_is_reported():
    rows = [_row("base", 100, 1), _row("zipf", 90, 1),
            _row("base", 120, 2), _row("zipf", 96, 2),  # 0.8: a fast base run
            _row("base", 95, 3), _row("zipf", 90.25, 3)]  # 0.95
    add_over_base(rows)
    assert [round(r["over_base"], 3) for r in rows] == [1.0, 0.9, 1.0, 0.8, 1.0, 0.95]
    summary = {r["popularity"]: r for r in summarize_rounds(rows)}
    zipf = summary["zipf"]
    assert zipf["round"] == 1 and zipf["over_base"] == 0.9  # the median round, a real run
    assert (zipf["over_base_min"], zipf["over_base_max"], zipf["rounds"]) == (0.8, 0.95, 3)
    assert zipf["over_base_rounds"] == [0.9, 0.8, 0.95]
    assert summary["base"]["output_tok_per_s"] == 100  # base: the median by throughput
    target = next(t for t in target_rows(None, None, {"throughput": rows}) if "zipf" in t["target"])
    assert target["measured"] == 0.9 and target["meets"] is False and "median of 3 rounds (0.8–0.95)" in target["note"]
    title, body = throughput_section(rows)
    assert "3 rounds of the popularity list" in body and "÷ base, round 3" in body


def test_one_round_is_reported_as_it_is():
    rows = [_row("base", 100, 1), _row("zipf", 93, 1)]
    add_over_base(rows)
    assert summarize_rounds(rows) is rows
    assert "rounds of the popularity list" not in throughput_section(rows)[1]
