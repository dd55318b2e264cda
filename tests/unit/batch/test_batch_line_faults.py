"""No exception of one line ends a batch run: a line that cannot be read, added or run fails alone (logged with its
traceback) and the others run; a failure of the run itself has its own exit code, 3, apart from 1 (some lines
failed). Review: one line with a lone surrogate escape crashed the whole run with a tokenizer TypeError (exit 1,
nothing written), and --resume crashed the same way every time."""

from __future__ import annotations

import json
import logging

from loraplex import LLM
from loraplex.batch.own_format import LoraplexFormat
from loraplex.batch.window import RollingWindow
from tests.unit.batch.test_batch_cli import _run, _write_jsonl


def test_a_lone_surrogate_escape_fails_its_line_and_resume_runs_the_rest(tiny_model, tmp_path):
    """``"prompt": "x\\udc80y"`` is valid JSON syntax but no text: its line fails as no JSON, as the server answers
    such a body, and the lines after it run; a resumed run goes on past it."""
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(src, ['{"id": "a", "prompt_token_ids": [1, 40], "params": {"max_tokens": 2}}',
                       '{"id": "lone", "prompt": "x\\udc80y"}',
                       '{"id": "b", "prompt": "hello", "params": {"max_tokens": 2}}',
                       '{"id": "c", "prompt": "hi", "params": {"max_tokens": 2}}'])
    assert _run(tiny_model, src, dst) == 1
    out = [json.loads(x) for x in dst.read_text().splitlines()]
    assert [o["id"] for o in out] == ["a", 2, "b", "c"]  # no readable id: the line number
    assert out[1]["error"].startswith("line 2 is not JSON: JSON is malformed: invalid utf-16 surrogate pair")
    assert all("outputs" in o for o in (out[0], out[2], out[3]))
    dst.write_text("".join(x + "\n" for x in dst.read_text().splitlines()[:2]))  # as a run stopped there leaves it
    assert _run(tiny_model, src, dst, "--resume") == 1  # the kept failed line still counts
    assert [json.loads(x)["id"] for x in dst.read_text().splitlines()] == ["a", 2, "b", "c"]


class _PythonPrompts(LoraplexFormat):
    """Lines as the offline API may hand them over: a Python string can hold what no JSON line can (a lone
    surrogate), which the engine's tokenizer refuses with a TypeError, not a ValueError."""

    def parse(self, seq, line_no, raw):
        line = super().parse(seq, line_no, raw)
        if line.id == "surrogate":
            line.prompt = "x\udc80y"
        if line.id == "unreadable":
            raise RuntimeError("a defect while reading this line")
        return line


def test_an_unexpected_exception_fails_its_line_only_and_is_logged_with_its_traceback(tiny_model, caplog):
    llm = LLM(tiny_model["model_dir"], dtype="float32")
    rows = [(n, json.dumps({"id": rid, "prompt": "hello", "params": {"max_tokens": 2}}).encode())
            for n, rid in enumerate(["a", "surrogate", "b", "unreadable", "c"], start=1)]
    written: list[bytes] = []
    window = RollingWindow(llm, written.append, _PythonPrompts({"temperature": 0.0}, False, 0), 2, 8)
    with caplog.at_level(logging.ERROR, logger="loraplex.batch.window"):
        assert window.run(iter(rows), stop=lambda: False, tick=lambda: None)
    out = [json.loads(x) for x in written]
    assert [o["id"] for o in out] == ["a", "surrogate", "b", "unreadable", "c"]
    assert out[1]["error"].startswith("internal error: TypeError: ") and "traceback" in out[1]["error"]
    assert out[3]["error"].startswith("internal error: RuntimeError: a defect while reading this line")
    assert [len(o["outputs"][0]["token_ids"]) for o in (out[0], out[2], out[4])] == [2, 2, 2]
    logged = [r for r in caplog.records if r.exc_info]
    assert [r.getMessage().split(";")[0] for r in logged] == ["batch: input line 2 could not be added to the engine",
                                                              "batch: input line 4 could not be read"]
    assert (window.stats.num_ok, window.stats.num_failed) == (3, 2)
    assert not llm.engine.has_unfinished_requests()


def test_a_failure_of_the_run_itself_exits_3_not_1(tiny_model, tmp_path, caplog):
    """OUTPUT on a full device: the run cannot go on, which is no line's failure (exit 1 means some lines failed and
    the others ran); the error is logged with its traceback."""
    src = tmp_path / "in.jsonl"
    _write_jsonl(src, [{"id": i, "prompt_token_ids": [1, 40 + i], "params": {"max_tokens": 2}} for i in range(3)])
    with caplog.at_level(logging.ERROR, logger="loraplex.batch.command"):
        assert _run(tiny_model, src, "/dev/full") == 3
    failed = [r for r in caplog.records if r.getMessage().startswith("batch: the run failed after writing 0 lines")]
    assert failed and failed[0].exc_info and isinstance(failed[0].exc_info[1], OSError)
