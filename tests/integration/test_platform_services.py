"""Platform on real PostgreSQL and Redis: migrations agree with the models, atomic Redis buckets,
and revocation that reaches another replica (its own Redis connection and auth cache) within 1 s."""

from __future__ import annotations

import asyncio
import time

import pytest

from loraplex.platform import tenants
from loraplex.platform.auth import Authenticator
from loraplex.platform.db import make_engine, make_session_factory
from loraplex.platform.errors import ApiError
from loraplex.platform.kv import RedisKV
from loraplex.platform.migrate import upgrade_async
from tests.e2e.server import FreshPostgres
from tests.integration.tcp_proxy import TcpProxy
from tests.unit.platform.test_migrations_sqlite import _diff


@pytest.fixture(scope="module")
def pg_url(postgres_url):
    with FreshPostgres(postgres_url) as url:
        yield url


async def test_postgres_models_match_migrations(pg_url):
    await upgrade_async(pg_url)
    await upgrade_async(pg_url)
    assert await _diff(pg_url) == []


async def test_redis_bucket_is_atomic_across_clients(redis_url):
    prefix = f"loraplex-test-{time.time_ns()}:"
    clients = [RedisKV(redis_url, prefix=prefix) for _ in range(4)]
    try:
        results = await asyncio.gather(*[
            c.token_bucket("shared", capacity=25, refill_per_s=0.001) for c in clients for _ in range(10)
        ])
        assert sum(r.allowed for r in results) == 25  # 40 takes from 4 connections, exactly 25 granted
        refused = [r for r in results if not r.allowed]
        assert all(r.retry_after_s > 0 for r in refused)
        r = await clients[0].token_bucket("shared", 25, 0.001, cost=-5, force=True)
        assert r.remaining == pytest.approx(5, abs=0.1)
        await clients[0].set("ttl", "x", ttl_s=0.2)
        assert await clients[1].get("ttl") == "x"
        await asyncio.sleep(0.3)
        assert await clients[1].get("ttl") is None
    finally:
        for c in clients:
            await c.close()


async def test_revocation_reaches_another_replica_within_a_second(pg_url, redis_url):
    await upgrade_async(pg_url)
    prefix = f"loraplex-test-{time.time_ns()}:"
    engine = make_engine(pg_url)
    sessions = make_session_factory(engine)
    kv_a, kv_b = RedisKV(redis_url, prefix=prefix), RedisKV(redis_url, prefix=prefix)
    # a long TTL: only the pub/sub invalidation can make replica B notice in time
    replica_b = Authenticator(sessions, kv_b, cache_ttl_s=300)
    await replica_b.start()
    try:
        async with sessions() as s:
            await tenants.create_tenant(s, f"t{time.time_ns()}")
            name = (await tenants.list_tenants(s))[-1].name
            key, new = await tenants.create_key(s, name)
        assert (await replica_b.authenticate(new.key)).key_id == key.id  # now cached on B
        async with sessions() as s:
            await tenants.revoke_key(s, kv_a, key.id)  # "replica A" revokes
        t0 = time.monotonic()
        while True:
            try:
                await replica_b.authenticate(new.key)
            except ApiError as exc:
                assert exc.status_code == 401
                break
            assert time.monotonic() - t0 < 1.0, "revocation did not reach replica B within 1 s"
            await asyncio.sleep(0.02)
    finally:
        await replica_b.stop()
        await kv_a.close()
        await kv_b.close()
        await engine.dispose()


def test_db_upgrade_command_on_postgres(postgres_url):
    """``loraplex db upgrade`` as a user runs it: a new process, settings from the environment."""
    import os
    import subprocess
    import sys

    from tests.e2e.server import ROOT

    with FreshPostgres(postgres_url) as url:
        env = {**os.environ, "LORAPLEX_DATABASE_URL": url}
        proc = subprocess.run([sys.executable, "-m", "loraplex.cli", "db", "upgrade"], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        from loraplex.platform.migrate import current_heads

        assert f"latest revision ({', '.join(sorted(current_heads(url)))})" in proc.stdout, proc.stdout
        assert "postgresql" in proc.stdout

        async def tables() -> set[str]:
            engine = make_engine(url)
            try:
                async with engine.connect() as conn:
                    rows = await conn.exec_driver_sql("SELECT tablename FROM pg_tables WHERE schemaname='public'")
                    return {r[0] for r in rows}
            finally:
                await engine.dispose()

        assert {"tenants", "api_keys", "alembic_version"} <= asyncio.run(tables())


def test_redis_outage_fails_closed_with_503(tmp_path, redis_url):
    from litestar.testing import TestClient

    from loraplex.platform.app import create_app
    from loraplex.settings import Settings

    proxy = TcpProxy.to_redis(redis_url)
    keys: list[str] = []
    settings = Settings(data_dir=str(tmp_path), redis_url=proxy.redis_url)
    app = create_app(settings, start_engine=False, on_bootstrap_key=keys.append)
    with TestClient(app) as c:
        c.headers["Authorization"] = f"Bearer {keys[0]}"
        assert c.post("/admin/tenants", json={"name": "acme"}).status_code == 201
        assert c.post("/admin/tenants/acme/suspend").status_code == 200  # publishes over Redis
        proxy.cut()
        r = c.post("/admin/tenants/acme/activate")
        assert r.status_code == 503 and r.json()["error"]["code"] == "service_unavailable"
        assert r.headers["retry-after"] and c.get("/health").status_code == 200
    proxy.close()



def test_postgres_outage_turns_readiness_down_not_liveness(tmp_path, postgres_url):
    """SECURITY.md 23: with the database gone, /ready answers 503 (the load balancer stops sending
    traffic this replica can only refuse) while /health stays 200 (no restart loop); it recovers."""
    import asyncpg
    from litestar.testing import TestClient
    from sqlalchemy.engine import make_url

    from loraplex.platform.app import create_app
    from loraplex.settings import Settings

    def admin(sql: str) -> None:
        base = make_url(postgres_url)

        async def run() -> None:
            conn = await asyncpg.connect(host=base.host, port=base.port or 5432, user=base.username,
                                         password=base.password, database=base.database)
            try:
                await conn.execute(sql)
            finally:
                await conn.close()

        asyncio.run(run())

    with FreshPostgres(postgres_url) as url:
        name = make_url(url).database
        app = create_app(Settings(data_dir=str(tmp_path), database_url=url), start_engine=False,
                         on_bootstrap_key=lambda key: None)
        with TestClient(app) as c:
            assert c.get("/ready").json()["status"] == "loading"  # no engine in this test; database fine
            # the database goes away: new connections refused, open ones cut
            admin(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
            admin(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{name}'")
            r = c.get("/ready")
            assert r.status_code == 503 and r.json()["status"] == "database_unavailable", r.text
            assert r.headers["retry-after"]
            assert c.get("/health").status_code == 200
            admin(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')
            assert c.get("/ready").json()["status"] == "loading"
