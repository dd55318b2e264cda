"""Start ``loraplex serve`` as a real subprocess on a free port, for end-to-end tests of any area.

    from tests.e2e.server import start_server

    @pytest.fixture(scope="module")
    def server(tmp_path_factory, tiny_model):
        srv = start_server(tmp_path_factory.mktemp("srv"), model=tiny_model["model_dir"])
        yield srv
        srv.stop()

    srv.base_url        # "http://127.0.0.1:PORT"
    srv.admin_key       # the bootstrap admin key printed once on first start
    srv.client()        # an httpx.Client with the admin key
    srv.create_tenant("acme") -> {"tenant": ..., "key": "lpx-..."}   # via the admin API
    srv.cli("admin", "tenant", "list")  # run the loraplex CLI against this server's settings

Without ``model`` the embedded default generates its demo model in the data dir on first start (seconds;
``demo_model_from=tiny_model["model_dir"]`` copies a prebuilt one there instead). ``database_url`` / ``redis_url`` switch to Postgres / Redis (``serve``
migrates the database at start).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from loraplex.bench.server_launch import KEY_RE, free_port, spawn_serve, stop_serve, wait_ready

ROOT = Path(__file__).resolve().parents[2]
__all__ = ["KEY_RE", "free_port", "start_server", "backend_server", "FreshPostgres", "BACKENDS", "LiveServer"]


@dataclass
class LiveServer:
    base_url: str
    admin_key: str
    data_dir: Path
    env: dict[str, str]
    proc: subprocess.Popen
    output: list[str] = field(default_factory=list)  # stdout+stderr lines so far

    def client(self, key: str | None = None, timeout: float = 30.0) -> httpx.Client:
        return httpx.Client(
            base_url=self.base_url, timeout=timeout,
            headers={"Authorization": f"Bearer {key or self.admin_key}"},
        )

    def create_tenant(self, name: str, scopes: list[str] | None = None, **limits) -> dict:
        """Create a tenant and one key for it through the admin API; returns both."""
        with self.client() as c:
            r = c.post("/admin/tenants", json={"name": name, **limits})
            r.raise_for_status()
            tenant = r.json()
            r = c.post("/admin/keys", json={"tenant": name, "scopes": scopes or ["inference"]})
            r.raise_for_status()
        return {"tenant": tenant, "key": r.json()["key"], "key_id": r.json()["id"]}

    def cli(self, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "loraplex.cli", *args], env=self.env, cwd=ROOT,
            capture_output=True, text=True, timeout=timeout,
        )

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_text(self) -> str:
        return "\n".join(self.output)

    def wait_none_in_flight(self, timeout_s: float = 60.0) -> None:
        """Until ``loraplex:requests_in_flight`` reads 0: every request admitted so far has left, its usage
        recorded (a client that cut its stream is done before the server has accounted for it)."""
        deadline = time.monotonic() + timeout_s
        while True:
            text = httpx.get(self.base_url + "/metrics").text
            value = next(float(line.split()[-1]) for line in text.splitlines()
                         if line.startswith("loraplex:requests_in_flight "))
            if value == 0:
                return
            assert time.monotonic() < deadline, f"{value:g} requests still in flight after {timeout_s:g} s"
            time.sleep(0.05)

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM (drain), wait, return the exit code (SIGKILL after ``timeout``)."""
        stop_serve(self.proc, timeout)
        return self.proc.returncode


def start_server(
    data_dir: Path,
    *,
    model: str | None = None,
    database_url: str | None = None,
    redis_url: str | None = None,
    env: dict[str, str] | None = None,
    args: list[str] | tuple[str, ...] = (),
    ready_timeout: float = 180.0,
    admin_key: str | None = None,
    demo_model_from: str | Path | None = None,
) -> LiveServer:
    """Start ``loraplex serve`` and wait for ``/ready``. ``env`` adds LORAPLEX_* settings.

    The bootstrap admin key is read from the server's output on first start; pass ``admin_key`` when
    restarting on a data dir / database that already has one. ``demo_model_from`` copies an already
    built demo model (e.g. the session ``tiny_model``) to where the embedded default keeps its own, so
    the server starts as the no-argument default without spending seconds generating one."""
    port = free_port()
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    if demo_model_from is not None and not (data_dir / "demo-model").exists():
        shutil.copytree(demo_model_from, data_dir / "demo-model")
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")}
    full_env.update({
        "LORAPLEX_DATA_DIR": str(data_dir),
        "LORAPLEX_HOST": "127.0.0.1",
        "LORAPLEX_PORT": str(port),
        "LORAPLEX_DEVICE": "cpu",
        "LORAPLEX_DRAIN_TIMEOUT_S": "30",
        "PYTHONUNBUFFERED": "1",
    })
    if model:
        full_env["LORAPLEX_MODEL"] = str(model)
    if database_url:
        full_env["LORAPLEX_DATABASE_URL"] = database_url
    if redis_url:
        full_env["LORAPLEX_REDIS_URL"] = redis_url
    full_env.update(env or {})
    proc, output = spawn_serve(list(args), full_env, cwd=ROOT)
    base = f"http://127.0.0.1:{port}"
    admin_key = wait_ready(proc, output, base, ready_timeout, admin_key)
    return LiveServer(base, admin_key, data_dir, full_env, proc, output)


# ---- a throwaway PostgreSQL database per test run ----------------------------------------------


class FreshPostgres:
    """``with FreshPostgres(postgres_url) as url:`` creates ``loraplex_test_<random>`` on the same server
    and drops it afterwards, so parallel and repeated runs never collide."""

    def __init__(self, base_url: str):
        import uuid

        from sqlalchemy.engine import make_url

        self._base = make_url(base_url)
        self.name = f"loraplex_test_{uuid.uuid4().hex[:12]}"
        self.url = self._base.set(database=self.name).render_as_string(hide_password=False)

    def _admin(self, sql: str) -> None:
        import asyncio

        import asyncpg

        async def run() -> None:
            b = self._base
            conn = await asyncpg.connect(host=b.host, port=b.port or 5432, user=b.username, password=b.password,
                                         database=b.database)
            try:
                await conn.execute(sql)
            finally:
                await conn.close()

        asyncio.run(run())

    def __enter__(self) -> str:
        self._admin(f'CREATE DATABASE "{self.name}"')
        return self.url

    def __exit__(self, *exc) -> None:
        self._admin(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')


BACKENDS = ("embedded", "postgres_redis")


@contextlib.contextmanager
def backend_server(request, tmp_path_factory, kind: str, env: dict[str, str] | None = None,
                   first_run: bool = False):
    """A live server on one backend, for fixtures parametrized over :data:`BACKENDS`:

    - ``embedded``: no model, no URLs (the no-argument default). ``first_run`` lets it generate its demo
      model; otherwise the session ``tiny_model`` is copied in as the demo model (faster).
    - ``postgres_redis``: a fresh Postgres database + Redis (fixtures ``postgres_url``/``redis_url``, which
      skip visibly when the services are absent), serving ``tiny_model``.

    Stops the server at the end and asserts a clean (exit 0) shutdown."""
    env = dict(env or {})
    tmp = tmp_path_factory.mktemp(kind)
    if kind == "embedded":
        seed = None if first_run else request.getfixturevalue("tiny_model")["model_dir"]
        srv = start_server(tmp, env=env, demo_model_from=seed)
        try:
            yield srv
        finally:
            rc = srv.stop()
        assert rc == 0, srv.log_text()[-3000:]
        return
    tiny = request.getfixturevalue("tiny_model")
    postgres_url = request.getfixturevalue("postgres_url")
    redis_url = request.getfixturevalue("redis_url")
    env.setdefault("LORAPLEX_SERVER_SECRET", "e2e-" + os.urandom(8).hex())
    with FreshPostgres(postgres_url) as db_url:
        srv = start_server(tmp, model=tiny["model_dir"], database_url=db_url, redis_url=redis_url, env=env)
        try:
            yield srv
        finally:
            rc = srv.stop()
        assert rc == 0, srv.log_text()[-3000:]
