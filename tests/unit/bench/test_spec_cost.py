"""The speculative-decoding cost bench: its break-even arithmetic, and a smoke run on the CPU (tiny model)."""

from __future__ import annotations

import json

import pytest

from loraplex.bench.spec_cost import FixedProposer, break_even


def test_break_even_acceptance():
    assert break_even(1.0, 4) == 0.0  # a free draft pays at any rate
    assert break_even(6.0, 4) is None  # 5 tokens per step at most
    a = break_even(1.5, 1)  # 1 + a = 1.5
    assert a == pytest.approx(0.5, abs=1e-9)
    a = break_even(2.0, 4)
    assert (1 - a ** 5) / (1 - a) == pytest.approx(2.0, rel=1e-9)
    assert break_even(1.2, 0) is None
    assert FixedProposer(3).propose([5, 6, 7], max_tokens=2) == [7, 7]


def test_smoke_run_writes_a_row_per_drafts_and_adapters(tmp_path):
    from loraplex.bench import spec_cost

    out = tmp_path / "s.json"
    assert spec_cost.main(["--smoke", "--work-dir", str(tmp_path / "w"), "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert [(r["adapters"], r["drafts"]) for r in payload["table"]] == [("base", 0), ("base", 2), ("distinct", 0),
                                                                        ("distinct", 2)]
    assert all(r["step_ms"] > 0 for r in payload["table"])
    assert all((r["draft_tokens_verified"] > 0) == (r["drafts"] > 0) for r in payload["rows"])
    assert "| distinct | 2 |" in out.with_suffix(".md").read_text()
