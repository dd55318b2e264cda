"""``bench all`` stopped by SIGTERM (as ``timeout`` does before a hard time limit): it still writes the report of
the parts that finished, says where it was cut, stops the server it launched, and exits 3."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path


def _terminate_when(args: list[str], trigger: str) -> tuple[int, str, int | None]:
    """Run ``loraplex <args>``, send it SIGTERM at the first output line containing ``trigger`` once it has
    launched its server; (exit code, its output, the server's pid)."""
    proc = subprocess.Popen([sys.executable, "-m", "loraplex.cli", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, server_pid = [], None
    try:
        for line in proc.stdout:
            lines.append(line)
            m = re.search(r"online: loraplex serve ready in .* \(pid (\d+)", line)
            if m:
                server_pid = int(m.group(1))
            if server_pid and trigger in line:
                proc.send_signal(signal.SIGTERM)
                break
        rest, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, "".join(lines) + rest, server_pid


def test_sigterm_during_the_online_part_writes_a_partial_report_and_stops_the_server(tmp_path):
    out = tmp_path / "out"
    # the requests go out at 1/s from the upload on: ~8 s
    rc, log, server_pid = _terminate_when(
        ["bench", "all", "--smoke", "--skip-lora-kernels", "--peer", "none", "--popularity", "base",
         "--online-rate", "1", "--work-dir", str(tmp_path / "work"), "--out-dir", str(out)], "online: uploaded")
    assert rc == 3, log[-3000:]
    assert "(most recent call first)" in log  # faulthandler: where every thread was when the signal came
    assert server_pid and not Path(f"/proc/{server_pid}").exists(), "the launched server outlived the bench"
    (json_path,) = out.glob("issue9-*.json")
    data = json.loads(json_path.read_text())
    assert data["cut_short"]["part"] == "online (launched loraplex serve)"
    assert data["attention"]["decode"] and "online" not in data and not data.get("offline")
    assert set(data["section_wall_s"]) == {"attention", "model files", "online (launched loraplex serve)"}
    md = next(out.glob("issue9-*.md")).read_text()
    assert "## Cut short" in md and "## Paged attention" in md and "## Offline throughput" not in md


def test_sigterm_stops_bench_online_and_the_server_it_launched(tmp_path):
    # the measured requests go out at 0.5/s after the warm-up
    rc, log, server_pid = _terminate_when(
        ["bench", "online", "--smoke", "--rate", "0.5", "--num-requests", "6", "--work-dir", str(tmp_path / "work"),
         "--out-dir", str(tmp_path / "out")], "warm-up requests")
    assert rc == 3, log[-3000:]
    assert server_pid and not Path(f"/proc/{server_pid}").exists(), "the launched server outlived the bench"
    assert "online: server stopped" in log


def test_a_run_killed_without_unwinding_leaves_the_parts_that_finished(tmp_path):
    """SIGKILL (or a crash) gives no chance to write at the end: the report rewritten after each part holds the
    parts that finished and says the run had not ended."""
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "loraplex.cli", "bench", "all", "--smoke", "--skip-lora-kernels",
                             "--peer", "none", "--popularity", "base", "--online-rate", "0",
                             "--work-dir", str(tmp_path / "work"), "--out-dir", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "bench all: engine start ..." in line:  # logged after the previous part's report was written
                proc.kill()
                break
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL, "".join(lines)[-3000:]
    (json_path,) = out.glob("issue9-*.json")
    data = json.loads(json_path.read_text())
    assert data["attention"]["decode"] and not data.get("offline")
    assert data["cut_short"]["reason"] == "the run had not ended when this copy was written"
    assert "engine start" not in data["section_wall_s"] and "model and adapter files" in data["section_wall_s"]
    md = next(out.glob("issue9-*.md")).read_text()
    assert "## Cut short" in md and "## Paged attention" in md


def test_a_copy_that_cannot_be_written_does_not_stop_the_run(tmp_path, monkeypatch, caplog):
    from loraplex.bench import full
    from loraplex.cli import main

    sections = full._sections

    def failing_copies(result, markdown):
        if result.get("cut_short"):  # the copies written after each part, not the final report
            raise KeyError("a figure not reportable yet")
        return sections(result, markdown)

    monkeypatch.setattr(full, "_sections", failing_copies)
    out = tmp_path / "out"
    rc = main(["bench", "all", "--smoke", "--skip-lora-kernels", "--peer", "none", "--popularity", "base",
               "--online-rate", "0", "--work-dir", str(tmp_path / "work"), "--out-dir", str(out)])
    assert rc == 0
    assert "no copy of the report after attention" in caplog.text
    (json_path,) = out.glob("issue9-*.json")
    data = json.loads(json_path.read_text())
    assert data["offline"] and "cut_short" not in data
