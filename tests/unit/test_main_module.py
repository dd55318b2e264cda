"""``python -m loraplex`` is the ``loraplex`` command (for a checkout or a venv whose scripts are not on PATH)."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT


def test_python_dash_m_loraplex_runs_the_cli():
    proc = subprocess.run([sys.executable, "-m", "loraplex", "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: loraplex ")
    for command in ("serve", "admin", "db", "batch"):
        assert command in proc.stdout
    # the exit code is the command's: a usage error is 2, as from the console script
    proc = subprocess.run([sys.executable, "-m", "loraplex", "admin", "key", "revoke"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "key_id" in proc.stderr
