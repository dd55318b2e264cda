"""Start ``loraplex serve`` for ``bench online --launch``: a fresh data dir, a free port, the bootstrap admin
key read from its output, adapters uploaded through ``POST /v1/adapters``; stopped with SIGTERM (drain)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

KEY_RE = re.compile(r"lpx-[a-z0-9]{12}-[A-Za-z0-9]{40}")  # a key as the server prints it (platform/auth.py)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_serve(args: list[str], env: dict[str, str], cwd: Path | None = None) -> tuple[subprocess.Popen, list[str]]:
    """``loraplex serve *args`` with exactly ``env``; its stdout and stderr lines gather in the returned list."""
    proc = subprocess.Popen([sys.executable, "-m", "loraplex.cli", "serve", *args], env=env, cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    output: list[str] = []

    def pump() -> None:
        for line in iter(proc.stdout.readline, ""):
            output.append(line.rstrip("\n"))
        proc.stdout.close()

    threading.Thread(target=pump, daemon=True).start()
    return proc, output


def wait_ready(proc: subprocess.Popen, output: list[str], base_url: str, ready_timeout: float,
               admin_key: str | None = None) -> str:
    """Until ``/ready`` answers 200 and the bootstrap admin key is known (``admin_key``, or read from the output);
    returns the key. RuntimeError when the server exits or its engine fails to start, TimeoutError after
    ``ready_timeout`` (the process is killed then)."""
    import httpx

    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"loraplex serve exited with {proc.returncode}:\n" + "\n".join(output[-60:]))
        admin_key = admin_key or next((m.group(0) for line in list(output) if "admin key" in line
                                       for m in [KEY_RE.search(line)] if m), None)
        try:
            r = httpx.get(base_url + "/ready", timeout=2.0)
            if r.status_code == 200 and admin_key:
                return admin_key
            if r.status_code == 503 and r.json().get("status") == "engine_failed":
                stop_serve(proc, 0)
                raise RuntimeError("the engine failed to start:\n" + "\n".join(output[-60:]))
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.1)
    stop_serve(proc, 0)
    raise TimeoutError(f"loraplex serve not ready after {ready_timeout:.0f} s:\n" + "\n".join(output[-60:]))


def stop_serve(proc: subprocess.Popen, timeout: float) -> bool:
    """SIGTERM (the server drains), SIGKILL after ``timeout`` seconds (at once with 0); whether it was killed."""
    if proc.poll() is not None:
        return False
    if timeout > 0:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
            return False
        except subprocess.TimeoutExpired:
            pass
    proc.kill()
    proc.wait()
    return True


@dataclass
class LaunchedServer:
    base_url: str
    admin_key: str
    proc: subprocess.Popen
    output: list[str] = field(default_factory=list)
    data_dir: Path | None = None
    env_overrides: dict[str, str] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)  # seconds: start, adapter uploads

    def base_model(self) -> str:
        import httpx

        r = httpx.get(self.base_url + "/v1/models", headers={"Authorization": f"Bearer {self.admin_key}"})
        r.raise_for_status()
        return r.json()["data"][0]["id"]

    def upload_adapter(self, path: Path, name: str) -> str:
        """Upload a PEFT directory; returns the name the API serves it under."""
        import httpx

        files = {
            "config": ("adapter_config.json", (path / "adapter_config.json").read_bytes(), "application/json"),
            "weights": ("adapter_model.safetensors", (path / "adapter_model.safetensors").read_bytes(),
                        "application/octet-stream"),
        }
        r = httpx.post(self.base_url + "/v1/adapters", data={"name": name}, files=files, timeout=600,
                       headers={"Authorization": f"Bearer {self.admin_key}"})
        if r.status_code != 201:
            raise RuntimeError(f"uploading adapter {name} failed: HTTP {r.status_code} {r.text[:300]}")
        return r.json()["model"]

    def stop(self, timeout: float = 60.0) -> dict:
        """SIGTERM (the server drains), SIGKILL after ``timeout``; returns how it ended."""
        started = time.monotonic()
        killed = stop_serve(self.proc, timeout)
        return {"pid": self.proc.pid, "exit_code": self.proc.returncode, "killed": killed,
                "stop_s": time.monotonic() - started}

    def embedded_state(self) -> dict:
        """What the server left in its data dir: the embedded default keeps its database there as SQLite.
        Read after ``stop``; ``database_url`` / ``redis_url`` say whether the server was given any (it was not)."""
        import sqlite3

        db = self.data_dir / "loraplex.db" if self.data_dir else None
        state = {"data_dir": str(self.data_dir), "sqlite_file": str(db) if db and db.exists() else None,
                 "database_url": self.env_overrides.get("LORAPLEX_DATABASE_URL"),
                 "redis_url": self.env_overrides.get("LORAPLEX_REDIS_URL")}
        if state["sqlite_file"]:
            con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
            try:
                for name in ("tenants", "adapters", "usage_records"):
                    state[f"num_{name}"] = con.execute(f"SELECT COUNT(*) FROM {name}").fetchone()[0]
            finally:
                con.close()
        return state


# set by the bench itself: its own data dir and address, and no database or Redis (the embedded default)
BENCH_OWNED = ("LORAPLEX_DATA_DIR", "LORAPLEX_HOST", "LORAPLEX_PORT", "LORAPLEX_DATABASE_URL", "LORAPLEX_REDIS_URL")


def launch_server(model_dir: Path, serve_args: list[str], ready_timeout: float = 900.0,
                  env: dict[str, str] | None = None) -> LaunchedServer:
    """``loraplex serve model_dir *serve_args`` on a free port with its own data dir; waits for ``/ready``.
    ``env``: more LORAPLEX_ settings for it (none of ``BENCH_OWNED``)."""

    port = free_port()
    data_dir = Path(tempfile.mkdtemp(prefix="loraplex-bench-serve-"))
    # only these LORAPLEX_ settings: no database or Redis URL, so the server runs the embedded default
    owned = sorted(set(env or {}) & set(BENCH_OWNED))
    if owned:
        raise ValueError(f"{', '.join(owned)}: set by the bench for the server it launches")
    overrides = {"LORAPLEX_DATA_DIR": str(data_dir), "LORAPLEX_HOST": "127.0.0.1", "LORAPLEX_PORT": str(port),
                 **(env or {})}
    proc_env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")}
    proc_env.update(overrides, PYTHONUNBUFFERED="1")
    proc, output = spawn_serve([str(model_dir), *serve_args], proc_env)
    base = f"http://127.0.0.1:{port}"
    key = wait_ready(proc, output, base, ready_timeout)
    return LaunchedServer(base, key, proc, output, data_dir, overrides)
