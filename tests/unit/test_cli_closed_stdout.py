"""Every command that writes to stdout, whose reader has gone away (``loraplex usage export | head -1``), stops as a
shell command stopped by SIGPIPE does: exit code 141 and one line on stderr, no BrokenPipeError traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from loraplex.cli import main

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> str:
    data = str(tmp_path_factory.mktemp("closed-stdout") / "data")
    assert main(["admin", "tenant", "create", "acme", "--data-dir", data]) == 0
    return data


def _run_with_stdout_closed(argv: list[str], *, buffered: bool) -> subprocess.CompletedProcess:
    """``loraplex ARGV`` whose stdout is a pipe that nobody reads any more: its reading end is closed before the
    command starts, so its first write fails whatever the pipe's buffer size (as the last write to a | head that
    has exited does)."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("PYTHONUNBUFFERED", None)
    if not buffered:  # print() then fails at once, inside the command; buffered, it fails at the last flush
        env["PYTHONUNBUFFERED"] = "1"
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run([sys.executable, "-m", "loraplex.cli", *argv], stdout=write_end, stderr=subprocess.PIPE,
                              env=env, timeout=120, text=True)
    finally:
        os.close(write_end)


@pytest.mark.parametrize("argv, buffered", [
    (["usage", "export"], True),
    (["usage", "export", "--group-by", "adapter"], False),  # an empty ledger still writes the CSV header
    (["admin", "tenant", "list"], True),
    (["admin", "tenant", "list", "--json"], False),
    (["admin", "key", "create", "--tenant", "acme"], True),
])
def test_a_closed_stdout_is_one_line_and_exit_141(argv, buffered, data_dir):
    proc = _run_with_stdout_closed([*argv, "--data-dir", data_dir], buffered=buffered)
    err = proc.stderr
    assert proc.returncode == 141, err[-2000:]
    assert "Traceback" not in err and "Exception ignored" not in err, err[-2000:]
    assert err.strip().splitlines()[-1] == f"loraplex {argv[0]}: stopped: the reader of stdout closed it", err


def test_a_broken_pipe_that_is_not_stdout_keeps_its_traceback(monkeypatch, tmp_path):
    """Only stdout's reader going away is a quiet 141: a BrokenPipeError from elsewhere (a worker's pipe) while
    stdout is fine is a bug to see, not something to hide."""
    from loraplex import cli

    def broken(args):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(cli, "build_parser", lambda: _parser_running(broken))
    with open(tmp_path / "stdout", "w") as stdout:
        monkeypatch.setattr(sys, "stdout", stdout)
        with pytest.raises(BrokenPipeError):
            cli.main(["boom"])


def _parser_running(func):
    import argparse

    parser = argparse.ArgumentParser(prog="loraplex")
    parser.add_argument("--log-level")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("boom").set_defaults(func=func)
    return parser
