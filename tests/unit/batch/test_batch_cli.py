"""``loraplex batch``: JSONL in, JSONL out in the same order, a bad line reported without stopping."""

from __future__ import annotations

import json
import logging
import signal
from pathlib import Path

import pytest
import torch

from loraplex import LLM, SamplingParams
from loraplex.cli import main
from tests.conftest import adapter_dir


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
        json.dumps({**good, "id": "wide", "params": {"n": 4}}).encode(),
    ]
    src.write_bytes(b"\n".join(lines) + b"\n")
    rc = main(["batch", str(src), str(dst), "--model", tiny_model["model_dir"], "--dtype", "float32",
               "--max-tokens", "3", "--max-model-len", "64", "--max-num-seqs", "2"])
    out = [json.loads(x) for x in dst.read_text().splitlines()]
    assert rc == 1
    assert [o["id"] for o in out] == ["ok", "long", "vocab", 4, "ok2", "wide"]  # no readable id: its line number
    # the limits named as the flags that set them
    assert "--max-model-len 64" in out[1]["error"] and "[0, 512)" in out[2]["error"]
    assert "--max-num-seqs" in out[5]["error"] and "max_num_seqs" not in out[5]["error"], out[5]
    assert "UTF-8" in out[3]["error"]
    want = LLM(tiny_model["model_dir"], dtype="float32").generate(
        {"prompt_token_ids": [1, 40, 41, 42]}, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert out[0]["outputs"][0]["token_ids"] == out[4]["outputs"][0]["token_ids"] == want[0].outputs[0].token_ids


# ---- the rolling window, resume, refusals, ids, progress, signals ------------------------------------------

MODEL_ARGS = ("--dtype", "float32")


def _run(tiny_model, src, dst, *extra) -> int:
    return main(["batch", str(src), str(dst), "--model", tiny_model["model_dir"], *MODEL_ARGS, *extra])


def _write_jsonl(path, items) -> None:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in items))


def _greedy(tiny_model, prompts_and_max_tokens) -> list[list[int]]:
    llm = LLM(tiny_model["model_dir"], dtype="float32")
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in prompts_and_max_tokens],
                        [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for _, m in prompts_and_max_tokens])
    return [o.outputs[0].token_ids for o in outs]


class _RecordingLLM(LLM):
    """The real LLM, recording when each request is added to its engine and when it finishes."""

    events: list = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        engine, events = self.engine, []
        type(self).events = events
        add, step = engine.add_request, engine.step

        def add_request(request_id, *a, **kw):
            add(request_id, *a, **kw)
            events.append(("add", int(request_id)))

        def recording_step():
            deltas = step()
            events.extend(("done", int(d.request_id)) for d in deltas if d.finished)
            return deltas

        engine.add_request, engine.step = add_request, recording_step


def test_rolling_window_adds_lines_while_a_long_one_runs_and_writes_in_input_order(tiny_model, tmp_path,
                                                                                   monkeypatch):
    """Line 0 runs 24 tokens, the others 2: with 2 lines in flight, lines 2 and 3 start while line 0 still runs
    (a chunked loop would wait for the whole first chunk); with a reorder buffer of 4, line 4 waits until line 0
    is written; the output is in input order and equals a plain greedy generate."""
    import loraplex.engine.llm as llm_module

    monkeypatch.setattr(llm_module, "LLM", _RecordingLLM)
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    jobs = [([1, 40, 41, 42], 24)] + [([1, 50 + i, 7], 2) for i in range(7)]
    _write_jsonl(src, [{"id": f"r{i}", "prompt_token_ids": p, "params": {"max_tokens": m, "ignore_eos": True}}
                       for i, (p, m) in enumerate(jobs)])
    rc = _run(tiny_model, src, dst, "--max-num-seqs", "2", "--max-in-flight", "2", "--reorder-buffer", "4")
    assert rc == 0
    out = [json.loads(x) for x in dst.read_text().splitlines()]
    assert [o["id"] for o in out] == [f"r{i}" for i in range(len(jobs))]
    assert [o["outputs"][0]["token_ids"] for o in out] == _greedy(tiny_model, jobs)
    events = _RecordingLLM.events
    long_done = events.index(("done", 0))
    assert events.index(("add", 2)) < long_done and events.index(("add", 3)) < long_done
    assert events.index(("add", 4)) > long_done  # the reorder buffer is full behind line 0
    in_flight = peak = 0
    for kind, _ in events:
        in_flight += 1 if kind == "add" else -1
        peak = max(peak, in_flight)
    assert peak == 2


def test_ids_keep_their_json_type_and_default_to_the_physical_line_number(tiny_model, tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join([
        "",  # line 1: blank, skipped, but counted
        json.dumps({"id": 5, "prompt": "Hello"}),
        json.dumps({"prompt": "Hello"}),  # line 3, no id
        json.dumps({"id": "5", "prompt": "Hello"}),
        "   ",
        "{not json",  # line 6
        json.dumps({"id": None, "prompt": "Hello"}),
        json.dumps(["a list"]),  # line 8
    ]) + "\n")
    rc = _run(tiny_model, src, dst, "--max-tokens", "1")
    out = [json.loads(x) for x in dst.read_text().splitlines()]
    assert rc == 1
    assert [o["id"] for o in out] == [5, 3, "5", 6, None, 8]
    assert type(out[0]["id"]) is int and "outputs" in out[0] and "outputs" in out[1]
    assert "line 6 is not JSON" in out[3]["error"] and "line 8 is not a JSON object" in out[5]["error"]


def _jobs_file(path, num: int) -> list:
    """Mixed lengths, some lines without an id, blank lines between (ids then follow physical lines)."""
    items, jobs = [], []
    for i in range(num):
        prompt, max_tokens = [1, 30 + i, 31 + 2 * i], (9 if i % 4 == 0 else 2 + i % 3)
        item = {"prompt_token_ids": prompt, "params": {"max_tokens": max_tokens, "ignore_eos": True}}
        if i % 3:
            item["id"] = f"q{i}"
        items.append(item)
        jobs.append((prompt, max_tokens))
        if i % 5 == 2:
            items.append("")
    _write_jsonl(path, items)
    return jobs


def test_resume_after_a_cut_short_last_line_gives_the_uninterrupted_file(tiny_model, tmp_path, monkeypatch):
    import loraplex.engine.llm as llm_module

    src, full, cut = tmp_path / "in.jsonl", tmp_path / "full.jsonl", tmp_path / "cut.jsonl"
    jobs = _jobs_file(src, 10)
    assert _run(tiny_model, src, full, "--max-num-seqs", "3") == 0
    lines = full.read_bytes().splitlines(keepends=True)
    assert len(lines) == 10
    cut.write_bytes(b"".join(lines[:4]) + lines[4][: len(lines[4]) // 2])  # as a SIGKILL mid-write leaves it
    monkeypatch.setattr(llm_module, "LLM", _RecordingLLM)
    assert _run(tiny_model, src, cut, "--max-num-seqs", "3", "--resume") == 0
    assert cut.read_bytes() == full.read_bytes()
    assert sum(kind == "add" for kind, _ in _RecordingLLM.events) == 6  # only the lines not yet written ran
    assert [json.loads(x)["outputs"][0]["token_ids"] for x in lines] == _greedy(tiny_model, jobs)


def test_resume_refuses_an_output_that_is_not_this_inputs(tiny_model, tmp_path, capsys):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(src, [{"id": "a", "prompt": "x"}, {"prompt": "y"}, {"id": 3, "prompt": "z"}])
    cases = [
        (["a", "b"], 'line 2 of {} has id "b" but input line 2 has id 2'),
        (["a", 2, "3"], 'line 3 of {} has id "3" but input line 3 has id 3'),
        (["a", 2, 3, 4], "has more lines than the input has lines to run (3)"),
    ]
    for ids, message in cases:
        _write_jsonl(dst, [{"id": i, "outputs": [{"index": 0, "finish_reason": "length"}]} for i in ids])
        before = dst.read_bytes()
        assert _run(tiny_model, src, dst, "--resume") == 2
        err = capsys.readouterr().err
        assert message.format(dst) in err and err.count("\n") == 1
        assert dst.read_bytes() == before
    for line in ("not json", json.dumps({"id": "a"})):
        dst.write_text(line + "\n")
        assert _run(tiny_model, src, dst, "--resume") == 2
        assert f"line 1 of {dst} is not a loraplex batch output line" in capsys.readouterr().err


def test_an_output_that_is_not_empty_is_kept_unless_resume_or_overwrite(tiny_model, tmp_path, capsys, caplog):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(src, [{"id": "a", "prompt": "Hello"}])
    dst.write_text("precious results\n")
    assert _run(tiny_model, src, dst) == 2
    err = capsys.readouterr().err
    assert "exists and is not empty" in err and "--resume" in err and "--overwrite" in err
    assert dst.read_text() == "precious results\n"
    assert _run(tiny_model, src, src, "--overwrite") == 2
    assert "is the INPUT file" in capsys.readouterr().err and json.loads(src.read_text())["id"] == "a"
    # --overwrite with a run that cannot start (the engine refuses an option) leaves OUTPUT and its options as they
    # were: the file was truncated before the model loaded
    options = tmp_path / "out.jsonl.options.json"
    options.write_text('{"earlier": true}')
    assert _run(tiny_model, src, dst, "--overwrite", "--max-model-len", "100000") == 2
    assert "--max-model-len" in capsys.readouterr().err
    assert dst.read_text() == "precious results\n" and options.read_text() == '{"earlier": true}'
    folder = tmp_path / "a-folder"
    folder.mkdir()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="loraplex"):
        assert _run(tiny_model, src, folder) == 2
    assert "is a folder" in capsys.readouterr().err
    assert not any("loading the model" in r.getMessage() for r in caplog.records)  # refused before the model is read
    assert _run(tiny_model, src, dst, "--overwrite", "--max-tokens", "1") == 0
    assert [json.loads(x)["id"] for x in dst.read_text().splitlines()] == ["a"]


def test_progress_counts_blank_lines_and_a_last_line_without_newline(tiny_model, tmp_path, caplog):
    """The progress total is the input's number of lines, counted in the pass that checks the ids: blank lines
    included (progress names input line numbers), and a last line without a newline."""
    import logging

    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    line = '{"id": %d, "prompt_token_ids": [1, 40], "params": {"ignore_eos": true}}'
    src.write_text(f"{line % 0}\n\n{line % 1}\n   \n{line % 2}")  # 5 lines, the last without a newline
    caplog.set_level(logging.INFO, logger="loraplex.batch.command")
    assert _run(tiny_model, src, dst, "--max-tokens", "2", "--progress-interval", "0") == 0
    progress = [r.getMessage() for r in caplog.records if r.name == "loraplex.batch.command"
                and r.getMessage().startswith("batch: ") and "lines written" in r.getMessage()]
    assert progress and all(" of 5 (" in m for m in progress)
    assert [json.loads(x)["id"] for x in dst.read_text().splitlines()] == [0, 1, 2]


def test_progress_lines_and_a_final_summary_on_stderr(tiny_model, tmp_path, caplog):
    import logging

    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(src, [{"id": i, "prompt_token_ids": [1, 40 + i], "params": {"ignore_eos": True}} for i in range(3)]
                 + ["{bad"])
    caplog.set_level(logging.INFO, logger="loraplex.batch.command")
    assert _run(tiny_model, src, dst, "--max-tokens", "3", "--progress-interval", "0") == 1
    messages = [r.getMessage() for r in caplog.records if r.name == "loraplex.batch.command"]
    progress = [m for m in messages if m.startswith("batch: ") and "lines written" in m]
    assert progress and all(" of 4 (" in m and "output tok/s" in m for m in progress)
    assert messages[-1].startswith("batch done: 3 lines ok, 1 failed; 6 prompt tokens, 9 output tokens in ")
    assert "output tok/s" in messages[-1]
    caplog.clear()
    assert _run(tiny_model, src, dst, "--max-tokens", "3", "--overwrite") == 1  # default: every 5 s
    messages = [r.getMessage() for r in caplog.records if r.name == "loraplex.batch.command"]
    assert not [m for m in messages if "lines written" in m] and messages[-1].startswith("batch done: ")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_writes_complete_lines_in_order_and_resume_continues(tiny_model, tmp_path, signum):
    import os
    import subprocess
    import sys
    import time
    from pathlib import Path

    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    items = [{"id": f"s{i}", "prompt_token_ids": [1, 20 + i % 300], "params": {"ignore_eos": True}}
             for i in range(400)]
    _write_jsonl(src, items)
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen([sys.executable, "-m", "loraplex.cli", "batch", str(src), str(dst), "--model",
                             tiny_model["model_dir"], *MODEL_ARGS, "--max-tokens", "8", "--max-num-seqs", "2"],
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            if dst.exists() and dst.read_bytes().count(b"\n") >= 2:
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the job ended before it could be stopped"
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signum, err[-2000:]
    assert f"stopped by {signal.Signals(signum).name}" in err and "--resume to continue" in err
    data = dst.read_bytes()
    assert data.endswith(b"\n")
    done = [json.loads(x)["id"] for x in data.splitlines()]
    assert 2 <= len(done) < len(items) and done == [x["id"] for x in items[: len(done)]]
    _write_jsonl(src, items[: len(done) + 3])  # the rest of a shorter job, to keep the test fast
    assert _run(tiny_model, src, dst, "--max-tokens", "8", "--max-num-seqs", "2", "--resume") == 0
    assert [json.loads(x)["id"] for x in dst.read_text().splitlines()] == [x["id"] for x in items[: len(done) + 3]]


def test_stdout_closed_by_its_reader_stops_with_one_line_and_exit_141(tiny_model, tmp_path):
    """``loraplex batch IN - | head -1``: the reader goes away; the command stops like a shell command on SIGPIPE
    (exit 141) with one line on stderr, no traceback and no advice to --resume (there is no file to resume)."""
    import os
    import subprocess
    import sys

    src = tmp_path / "in.jsonl"
    _write_jsonl(src, [{"id": i, "prompt_token_ids": [1, 20 + i], "params": {"ignore_eos": True}} for i in range(300)])
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen([sys.executable, "-m", "loraplex.cli", "batch", str(src), "-", "--model",
                             tiny_model["model_dir"], *MODEL_ARGS, "--max-tokens", "4", "--max-num-seqs", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        first = proc.stdout.readline()
        proc.stdout.close()
        err = proc.stderr.read().decode()
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert json.loads(first)["id"] == 0
    assert proc.returncode == 141, err[-2000:]
    assert "Traceback" not in err and "Exception ignored" not in err and "--resume" not in err, err[-2000:]
    assert "the reader of stdout closed it" in err


# the batch command with a model load that waits (a hook, so that the SIGINT surely comes while it loads)
_SLOW_LOAD = """
import signal, sys, time
# Ctrl-C as a terminal delivers it: a child of a background job (nohup ... &, some CI runners) starts with SIGINT
# ignored, and Python then raises no KeyboardInterrupt at all
signal.signal(signal.SIGINT, signal.default_int_handler)
import loraplex.engine.llm
def slow_load(self, *args, **kwargs):
    sys.stderr.write("hook: loading\\n")
    sys.stderr.flush()
    time.sleep(30)
loraplex.engine.llm.LLM.__init__ = slow_load
from loraplex.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_ctrl_c_while_the_model_loads_is_one_line_and_exit_130(tmp_path):
    """SIGINT before the lines start (here while the model loads) was a KeyboardInterrupt traceback."""
    import os
    import subprocess
    import sys

    src, dst, model = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "model"
    _write_jsonl(src, [{"id": "a", "prompt": "Hi"}])
    model.mkdir()
    (model / "config.json").write_text("{}")
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_LOAD, "batch", str(src), str(dst), "--model", str(model)],
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        before = []
        for line in proc.stderr:
            before.append(line)
            if line == "hook: loading\n":
                break
        proc.send_signal(signal.SIGINT)
        err = "".join(before) + proc.stderr.read()
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "hook: loading\n" in before, err[-2000:]
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-2000:]
    assert err.strip().splitlines()[-1] == "loraplex batch: interrupted before the first line ran", err[-2000:]


def test_resume_refuses_other_generation_options_naming_them(tiny_model, tmp_path, capsys):
    """The kept lines and the new ones must come from the same options: a --resume that changes one is refused
    in one line naming the flag, and OUTPUT stays as it was (--max-num-seqs is one: a line whose n exceeds it
    fails); flags that only schedule (--max-in-flight, --reorder-buffer) may change; --overwrite starts over with
    new options, which a later --resume then holds to."""
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(src, [{"id": i, "prompt_token_ids": [1, 40 + i], "params": {"ignore_eos": True}} for i in range(3)])
    assert _run(tiny_model, src, dst, "--max-tokens", "4") == 0
    lines = dst.read_bytes().splitlines(keepends=True)
    dst.write_bytes(lines[0])  # as an interrupted run leaves it
    another_model = tmp_path / "another-model"  # a model directory to the first check, refused before it loads
    another_model.mkdir()
    (another_model / "config.json").write_bytes((Path(tiny_model["model_dir"]) / "config.json").read_bytes())
    cases = [(["--max-tokens", "5"], "--max-tokens 5"), (["--temperature", "0.7"], "--temperature 0.7"),
             (["--seed", "1"], "--seed 1"), (["--max-model-len", "64"], "--max-model-len 64"),
             (["--dtype", "bfloat16"], '--dtype "bfloat16"'), (["--enable-lora"], "--enable-lora true"),
             (["--kv-cache-dtype", "int8"], '--kv-cache-dtype "int8"'), (["--max-num-seqs", "2"], "--max-num-seqs 2"),
             (["--model", str(another_model)], "--model")]
    for flags, named in cases:
        assert _run(tiny_model, src, dst, "--resume", "--max-tokens", "4", *flags) == 2
        err = capsys.readouterr().err
        assert named in err and "--overwrite" in err and err.count("\n") == 1, err
        assert dst.read_bytes() == lines[0]
    assert _run(tiny_model, src, dst, "--resume", "--max-tokens", "4", "--max-in-flight", "1",
                "--reorder-buffer", "5") == 0
    assert dst.read_bytes() == b"".join(lines)
    assert _run(tiny_model, src, dst, "--overwrite", "--max-tokens", "2") == 0
    dst.write_bytes(dst.read_bytes().splitlines(keepends=True)[0])
    assert _run(tiny_model, src, dst, "--resume", "--max-tokens", "4") == 2
    assert "--max-tokens 4" in capsys.readouterr().err


def test_resume_of_an_options_file_without_kv_cache_dtype_takes_it_as_auto(tiny_model, tmp_path, capsys):
    """An OUT.options.json written before --kv-cache-dtype was recorded resumes with the default, and is
    refused with another value (an int8 or fp8 cache gives other tokens than the kept lines')."""
    from loraplex.batch import run_options as batch_options

    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(src, [{"id": i, "prompt_token_ids": [1, 40 + i], "params": {"ignore_eos": True}} for i in range(2)])
    assert _run(tiny_model, src, dst, "--max-tokens", "3") == 0
    lines = dst.read_bytes().splitlines(keepends=True)
    options = batch_options.recorded(str(dst))
    assert options.pop("kv_cache_dtype") == "auto"
    Path(batch_options.path_of(str(dst))).write_text(json.dumps(options))
    dst.write_bytes(lines[0])
    assert _run(tiny_model, src, dst, "--max-tokens", "3", "--resume", "--kv-cache-dtype", "fp8") == 2
    assert '--kv-cache-dtype "fp8" (earlier "auto")' in capsys.readouterr().err
    assert dst.read_bytes() == lines[0]
    assert _run(tiny_model, src, dst, "--max-tokens", "3", "--resume") == 0
    assert dst.read_bytes() == b"".join(lines)


def test_resume_counts_the_failed_lines_it_keeps_in_the_exit_code(tiny_model, tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(src, ["{bad", {"id": "b", "prompt": "Hello"}])
    dst.write_text(json.dumps({"id": 1, "error": "line 1 is not JSON"}) + "\n")
    assert _run(tiny_model, src, dst, "--max-tokens", "1", "--resume") == 1
    assert [json.loads(x)["id"] for x in dst.read_text().splitlines()] == [1, "b"]


@pytest.mark.parametrize("flags, want", [([], False), (["--enable-lora"], True), (["--no-enable-lora"], False),
                                         (["--enable-lora", "--no-enable-lora"], False)])
def test_enable_lora_is_spelled_like_serve(flags, want):
    """``batch`` takes ``--enable-lora/--no-enable-lora`` like ``serve`` (a script can pass either)."""
    from loraplex.cli import build_parser

    args = build_parser().parse_args(["batch", "in.jsonl", "out.jsonl", "--model", "m", *flags])
    assert args.enable_lora is want
    serve = build_parser().parse_args(["serve", *flags])
    assert serve.enable_lora is (want if flags else None)  # serve: None = the setting's default


def test_mistyped_prompt_token_ids_and_lora_fields_fail_their_line_naming_the_field(tiny_model, tmp_path):
    """prompt_token_ids of floats, booleans or strings were cast with int() (1.7 ran as token 1), a lora id of
    1.9 ran as adapter 1, and a non-list prompt_token_ids or a lora id "abc" failed with Python's own message
    ("'int' object is not iterable", "invalid literal for int()") naming no field; an unknown params key
    failed with "SamplingParams.__init__() got an unexpected keyword argument"."""
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    adapter = {"name": "a", "path": str(tmp_path)}
    _write_jsonl(src, [
        {"id": "float", "prompt_token_ids": [1.7, 40]},
        {"id": "bool", "prompt_token_ids": [True, 40]},
        {"id": "string", "prompt_token_ids": ["1", 40]},
        {"id": "scalar", "prompt_token_ids": 5},
        {"id": "lora-str", "prompt": "Hi", "lora": {**adapter, "id": "abc"}},
        {"id": "lora-float", "prompt": "Hi", "lora": {**adapter, "id": 1.9}},
        {"id": "lora-path", "prompt": "Hi", "lora": {**adapter, "id": 1, "path": 5}},
        {"id": "param", "prompt": "Hi", "params": {"max_tokens": 2, "temprature": 0.5}},
        {"id": "ok", "prompt_token_ids": [1, 40]},
    ])
    assert _run(tiny_model, src, dst, "--max-tokens", "2", "--enable-lora") == 1
    out = {o["id"]: o for o in map(json.loads, dst.read_text().splitlines())}
    for rid in ("float", "bool", "string", "scalar"):
        assert "prompt_token_ids" in out[rid].get("error", ""), out[rid]
    for rid, field in (("lora-str", "lora.id"), ("lora-float", "lora.id"), ("lora-path", "lora.path"),
                       ("param", "params.temprature")):
        assert field in out[rid].get("error", ""), out[rid]
    assert out["ok"]["outputs"][0]["token_ids"] == _greedy(tiny_model, [([1, 40], 2)])[0]


@pytest.mark.parametrize("stdin", [False, True])
def test_repeated_ids_are_refused_before_anything_runs_naming_the_lines(stdin, tiny_model, tmp_path, capsys,
                                                                        monkeypatch):
    """Two lines with one id (an explicit one, or a line without an id whose line number is another line's id)
    ran, and their output lines could not be told apart: the input is refused up front, as OpenAI's batch API
    refuses a repeated custom_id, naming the id and the lines; OUTPUT is not created."""
    import io

    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(src, [
        {"id": 3, "prompt": "a"},
        {"prompt": "b"},  # line 2: id 2
        {"prompt": "c"},  # line 3: id 3, as line 1
        {"id": "x", "prompt": "d"},
        {"id": 2, "prompt": "e"},  # as line 2
        {"id": "x", "prompt": "f"},
        {"id": "3", "prompt": "g"},  # the string "3" is another id than the number 3
        {"id": "x", "prompt": "h"},
    ])
    if stdin:
        monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(src.read_bytes())))
    rc = main(["batch", "-" if stdin else str(src), str(dst), "--model", tiny_model["model_dir"], *MODEL_ARGS])
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = [x for x in err.splitlines() if "loraplex batch: error:" in x]
    assert len(lines) == 1 and "Traceback" not in err and "engine ready" not in err, err
    assert "id 3 on lines 1 and 3 (line 3 has no id, so its id is its line number)" in lines[0], err
    assert "id 2 on lines 2 and 5 (line 2 has no id" in lines[0], err
    assert 'id "x" on lines 4, 6 and 8' in lines[0] and '"3"' not in lines[0], err
    assert not dst.exists()


def test_stdin_input_runs_like_a_file(tiny_model, tmp_path, monkeypatch):
    """INPUT - is copied to a temporary file first (its ids are checked before the first line runs); the lines,
    their order and the default ids are those of the same file."""
    import io

    params = {"ignore_eos": True}
    items = [{"id": "a", "prompt_token_ids": [1, 40], "params": params}, "",
             {"prompt_token_ids": [1, 41], "params": params}]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(src, items)
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(src.read_bytes())))
    assert _run(tiny_model, "-", dst, "--max-tokens", "2") == 0
    out = [json.loads(x) for x in dst.read_text().splitlines()]
    assert [o["id"] for o in out] == ["a", 3]
    assert [o["outputs"][0]["token_ids"] for o in out] == _greedy(tiny_model, [([1, 40], 2), ([1, 41], 2)])


def test_overwrite_refuses_an_output_that_is_the_file_stdin_reads(tiny_model, tmp_path, monkeypatch, capsys):
    """``loraplex batch - IN.jsonl --overwrite < IN.jsonl`` truncated its own input before reading its lines: 0 lines
    written, exit 0, the input gone. INPUT - read from OUTPUT is refused as INPUT OUTPUT is."""
    import io

    src = tmp_path / "in.jsonl"
    _write_jsonl(src, [{"id": "a", "prompt_token_ids": [1, 40]}, {"id": "b", "prompt_token_ids": [1, 41]}])
    before = src.read_bytes()
    with open(src, "rb") as f:
        monkeypatch.setattr("sys.stdin", io.TextIOWrapper(f))
        assert _run(tiny_model, "-", src, "--overwrite", "--max-tokens", "2") == 2
    assert "is the INPUT file" in capsys.readouterr().err
    assert src.read_bytes() == before


def test_an_output_that_is_not_a_regular_file_is_written_like_stdout(tiny_model, tmp_path, capsys):
    """OUTPUT /dev/null, a named pipe or /dev/stdout failed writing OUTPUT.options.json beside it (as root it wrote
    /dev/null.options.json): such an OUTPUT gets the lines and nothing beside it, and --resume is refused."""
    import os
    import threading

    src, fifo = tmp_path / "in.jsonl", tmp_path / "out.fifo"
    params = {"ignore_eos": True}
    _write_jsonl(src, [{"id": "a", "prompt_token_ids": [1, 40], "params": params},
                       {"id": "b", "prompt_token_ids": [1, 41], "params": params}])
    os.mkfifo(fifo)
    received: list[bytes] = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_bytes()), daemon=True)
    reader.start()
    rc = _run(tiny_model, src, fifo, "--max-tokens", "2")
    reader.join(timeout=60)
    err = capsys.readouterr().err
    assert rc == 0, err
    out = [json.loads(x) for x in received[0].decode().splitlines()]
    assert [o["id"] for o in out] == ["a", "b"]
    assert [o["outputs"][0]["token_ids"] for o in out] == _greedy(tiny_model, [([1, 40], 2), ([1, 41], 2)])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out.fifo"]  # no out.fifo.options.json

    assert _run(tiny_model, src, os.devnull, "--resume") == 2
    err = capsys.readouterr().err
    assert "--resume needs OUTPUT to be a regular file, not /dev/null" in err and "Traceback" not in err, err


def test_dev_stdout_redirected_to_a_file_is_written_like_stdout(tiny_model, tmp_path, capfd):
    """``loraplex batch IN /dev/stdout > out.jsonl``: /dev/stdout is then a regular file, so the run wrote
    /dev/stdout.options.json into /dev (as root; refused after the model loaded as anyone else), and a stdout appended
    to (``>> log``) was "not empty", refused. A path naming a descriptor of the process is written like ``-``."""
    import os

    src = tmp_path / "in.jsonl"
    _write_jsonl(src, [{"id": "a", "prompt_token_ids": [1, 40], "params": {"ignore_eos": True}}])
    print("earlier output", flush=True)  # pytest's capture: fd 1 is a regular file that is not empty
    try:
        for output in ("/dev/stdout", "/proc/self/fd/1"):
            assert os.path.isfile(output)
            rc = _run(tiny_model, src, output, "--max-tokens", "2")
            captured = capfd.readouterr()
            assert rc == 0, captured.err
            assert [json.loads(x)["id"] for x in captured.out.splitlines() if x.startswith("{")] == ["a"]
            assert output != "/dev/stdout" or captured.out.startswith("earlier output\n")  # appended, not truncated
            assert not os.path.exists(output + ".options.json")
        assert _run(tiny_model, src, "/dev/stdout", "--resume") == 2
        assert "--resume needs OUTPUT to be a regular file, not /dev/stdout" in capfd.readouterr().err
    finally:
        for output in ("/dev/stdout", "/proc/self/fd/1"):
            if os.path.exists(output + ".options.json"):
                os.remove(output + ".options.json")


def test_a_lora_line_without_enable_lora_fails_naming_the_flag(tiny_model, tmp_path):
    """Its error named the engine's field ("this engine was started without enable_lora"), not the flag to pass;
    the other lines still run."""
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(src, [
        {"id": "lora", "prompt_token_ids": [1, 40], "lora": {"name": "a", "id": 1, "path": adapter_dir(tiny_model, 0)}},
        {"id": "base", "prompt_token_ids": [1, 40]},
    ])
    assert _run(tiny_model, src, dst, "--max-tokens", "2") == 1
    out = {o["id"]: o for o in map(json.loads, dst.read_text().splitlines())}
    assert "--enable-lora" in out["lora"]["error"] and "enable_lora" not in out["lora"]["error"], out["lora"]
    assert out["base"]["outputs"][0]["token_ids"] == _greedy(tiny_model, [([1, 40], 2)])[0]


@pytest.mark.parametrize("flags, needles", [
    (["--model", "{tmp}/no-such-model"], ["--model", "no-such-model"]),
    (["--model", "{tmp}"], ["--model", "config.json"]),  # a directory, but not a model
    (["--dtype", "float64"], ["--dtype", "float64"]),
    (["--max-model-len", "100000"], ["--max-model-len", "100000"]),
    (["--max-model-len", "0"], ["--max-model-len"]),  # the engine started with a context of 0 tokens
    (["--device", "tpu"], ["--device", "tpu"]),
    pytest.param(["--device", "cuda"], ["--device", "CUDA is not available"],
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")),
    (["--max-tokens", "0"], ["--max-tokens", ">= 1"]),
    (["--temperature", "-1"], ["--temperature", ">= 0"]),
    (["--max-num-seqs", "0"], ["--max-num-seqs"]),
    (["--enable-lora", "--max-loras", "0"], ["--max-loras"]),
    (["--enable-lora", "--max-lora-rank", "0"], ["--max-lora-rank"]),
])
def test_bad_command_options_are_one_error_line_and_exit_2(flags, needles, tiny_model, tmp_path, capsys):
    """A model directory that does not exist, or an engine option it refuses, was a traceback with exit 1
    (which means "some line failed"); --max-tokens 0 or --temperature -1 failed every line one by one."""
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(src, [{"id": "a", "prompt": "Hi"}])
    argv = ["batch", str(src), str(dst), "--model", tiny_model["model_dir"], *MODEL_ARGS,
            *(f.replace("{tmp}", str(tmp_path)) for f in flags)]
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = [x for x in err.splitlines() if "loraplex batch: error:" in x]
    assert len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], err
    assert not dst.exists() or dst.stat().st_size == 0


def test_a_byte_order_mark_at_the_start_of_the_input_is_not_part_of_the_first_line(tiny_model, tmp_path):
    """Files saved as "UTF-8 with BOM" (Windows editors, PowerShell 5) failed their first line as "not JSON"."""
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_bytes(b'\xef\xbb\xbf{"id": "first", "prompt_token_ids": [1, 40]}\r\n{"id": "second", "prompt": "\xef\xbb\xbf"}\r\n')
    assert _run(tiny_model, src, dst, "--max-tokens", "2") == 0
    out = [json.loads(x) for x in dst.read_text().splitlines()]
    assert [o["id"] for o in out] == ["first", "second"]
    assert out[0]["outputs"][0]["token_ids"] == _greedy(tiny_model, [([1, 40], 2)])[0]


def test_logprobs_and_prompt_logprobs_asked_for_in_params_are_written(tiny_model, tmp_path):
    """params.logprobs / prompt_logprobs were accepted and run, and then left out of the output line."""
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    prompt = [1, 40, 41, 42]
    _write_jsonl(src, [{"id": "lp", "prompt_token_ids": prompt, "params": {"logprobs": 2, "prompt_logprobs": 1}},
                       {"id": "plain", "prompt_token_ids": prompt}])
    assert _run(tiny_model, src, dst, "--max-tokens", "3") == 0
    lp, plain = [json.loads(x) for x in dst.read_text().splitlines()]
    want = LLM(tiny_model["model_dir"], dtype="float32").generate(
        {"prompt_token_ids": prompt}, SamplingParams(max_tokens=3, temperature=0, logprobs=2, prompt_logprobs=1))[0]
    comp = want.outputs[0]
    got = lp["outputs"][0]
    assert got["token_ids"] == comp.token_ids and len(got["logprobs"]) == len(comp.token_ids)
    for entry, want_entry in zip(got["logprobs"], comp.logprobs):
        assert {int(t) for t in entry} == set(want_entry)
        for t, v in entry.items():
            w = want_entry[int(t)]
            assert v == {"logprob": pytest.approx(w.logprob), "rank": w.rank, "decoded_token": w.decoded_token}
    assert got["cumulative_logprob"] == pytest.approx(comp.cumulative_logprob)
    assert lp["prompt_logprobs"][0] is None and len(lp["prompt_logprobs"]) == len(prompt)
    assert {int(t) for t in lp["prompt_logprobs"][1]} == set(want.prompt_logprobs[1])
    assert "logprobs" not in plain["outputs"][0] and "prompt_logprobs" not in plain  # only when asked for


def test_kv_cache_dtype_flag_reaches_the_engine(tiny_model, tmp_path, capsys):
    """``--kv-cache-dtype fp8`` gives the tokens of an fp8 LLM; an unknown value is a one-line flag error."""
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"id": "a", "prompt_token_ids": [1] + list(range(60, 90))}) + "\n")
    rc = main(["batch", str(src), str(dst), "--model", tiny_model["model_dir"], "--dtype", "float32",
               "--kv-cache-dtype", "fp8", "--max-tokens", "6"])
    assert rc == 0
    got = json.loads(dst.read_text())["outputs"][0]["token_ids"]
    params = SamplingParams(max_tokens=6, temperature=0)
    want = LLM(tiny_model["model_dir"], dtype="float32", kv_cache_dtype="fp8").generate(
        {"prompt_token_ids": [1] + list(range(60, 90))}, params)[0].outputs[0].token_ids
    assert got == want
    dst.unlink()
    rc = main(["batch", str(src), str(dst), "--model", tiny_model["model_dir"], "--kv-cache-dtype", "int4"])
    assert rc != 0 and not dst.exists()
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith("--kv-cache-dtype must be one of auto, fp8, fp8_e4m3, int8, got 'int4'"), err


def test_sampled_lines_without_a_seed_do_not_depend_on_what_ran_beside_them(tiny_model, tmp_path):
    """Each line without a seed of its own samples with one derived from --seed and its id: the same tokens with any
    --max-num-seqs, and so across --resume (which runs the later lines in other batches)."""
    src = tmp_path / "in.jsonl"
    _write_jsonl(src, [{"prompt": f"line {i}"} for i in range(10)])
    outs = []
    for i, seqs in enumerate(("1", "8")):
        dst = tmp_path / f"out{i}.jsonl"
        assert _run(tiny_model, src, dst, "--temperature", "1.0", "--max-tokens", "6", "--max-num-seqs", seqs) == 0
        outs.append([json.loads(x)["outputs"][0]["token_ids"] for x in dst.read_text().splitlines()])
    assert outs[0] == outs[1]
    assert len({tuple(t) for t in outs[0]}) > 1  # sampled, and each line its own draw
    dst = tmp_path / "other-seed.jsonl"
    assert _run(tiny_model, src, dst, "--temperature", "1.0", "--max-tokens", "6", "--seed", "1") == 0
    assert [json.loads(x)["outputs"][0]["token_ids"] for x in dst.read_text().splitlines()] != outs[0]


def test_a_model_directory_without_a_tokenizer_says_so_and_tokenizer_names_one(tiny_model, tmp_path, capsys):
    import shutil

    bare = tmp_path / "weights-only"
    bare.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(Path(tiny_model["model_dir"]) / name, bare / name)
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(src, [{"id": "a", "prompt": "Hello"}])
    assert main(["batch", str(src), str(dst), "--model", str(bare), *MODEL_ARGS]) == 2
    err = capsys.readouterr().err
    assert "holds no tokenizer files" in err and "sentencepiece" not in err, err
    assert main(["batch", str(src), str(dst), "--model", str(bare), "--tokenizer", tiny_model["model_dir"],
                 *MODEL_ARGS, "--max-tokens", "2"]) == 0
    assert json.loads(dst.read_text())["id"] == "a"
    recorded = json.loads((tmp_path / "out.jsonl.options.json").read_text())
    assert recorded["tokenizer"] == str(Path(tiny_model["model_dir"]).resolve())
