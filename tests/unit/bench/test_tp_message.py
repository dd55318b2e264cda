"""The tensor-parallel step-message bench: it runs, its mirror stays in step with rank 0 (checked inside ``run`` by
the receiver's own updates), and the mirrored message is smaller than the requests pickled whole."""

from __future__ import annotations

from loraplex.bench.tp_message import main, run


def test_message_bench_runs_and_mirrored_messages_are_smaller(tmp_path):
    row = run(8, 200, 20)
    assert row["message_kB"] < row["whole_kB"] / 5
    assert main(["--seqs", "4", "--context", "64", "--steps", "2", "--out", str(tmp_path / "m.json")]) == 0
    text = (tmp_path / "m.md").read_text()
    assert "python -m loraplex.bench.tp_message --seqs 4" in text and "| 4 | 64 |" in text
