"""PostgreSQL unreachable while the server runs (SECURITY.md 23): liveness stays up, readiness goes down, and
requests that need the database get 503 ``database_unavailable`` + ``Retry-After``, never a 500.

When the pool has to open a new connection, asyncpg raises the socket's own error (connection refused or
reset, a timeout), which SQLAlchemy passes on untranslated; those used to escape as 500 ``internal_error``.
A database that accepts connections and never answers ("silent") answers within the connect timeout
(LORAPLEX_DATABASE_CONNECT_TIMEOUT_S), not after asyncpg's default minute.
"""

from __future__ import annotations

import asyncio
import time
from urllib.parse import urlsplit, urlunsplit

import pytest
from litestar.testing import AsyncTestClient
from sqlalchemy import text

from loraplex.platform.app import create_app
from loraplex.platform.db import make_engine
from loraplex.platform.migrate import upgrade_async
from loraplex.settings import Settings
from tests.e2e.server import FreshPostgres
from tests.integration.tcp_proxy import TcpProxy


@pytest.fixture
def pg_url(postgres_url):
    with FreshPostgres(postgres_url) as url:
        yield url


def _through(proxy: TcpProxy, url: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=f"{parts.username}@127.0.0.1:{proxy.port}"))


@pytest.mark.parametrize("outage", ["reset", "refused", "silent"])
async def test_requests_get_503_database_unavailable(outage, tmp_path, pg_url):
    await upgrade_async(pg_url)
    target = urlsplit(pg_url)
    proxy = TcpProxy((target.hostname, target.port or 5432))
    keys: list[str] = []
    settings = Settings(data_dir=str(tmp_path), database_url=_through(proxy, pg_url), database_connect_timeout_s=1.0)
    app = create_app(settings, start_engine=False, on_bootstrap_key=keys.append)
    try:
        async with AsyncTestClient(app, timeout=30) as client:
            admin = {"Authorization": f"Bearer {keys[0]}"}
            assert (await client.post("/admin/tenants", json={"name": "acme"}, headers=admin)).status_code == 201
            r = await client.post("/admin/keys", json={"tenant": "acme"}, headers=admin)
            fresh = {"Authorization": f"Bearer {r.json()['key']}"}  # never authenticated: not cached
            await app.state.services.db.dispose()  # the next query opens a new connection, through the outage
            if outage == "reset":
                proxy.cut()  # accepted, then closed at once
            elif outage == "silent":
                proxy.silence()  # accepted, never answered
            else:
                proxy.close()  # nothing listens: connection refused
            await asyncio.sleep(0.6)  # past the embedded auth cache's TTL (0.5 s)

            assert (await client.get("/health")).status_code == 200
            r = await client.get("/ready")
            assert r.status_code == 503 and r.json()["status"] == "database_unavailable"
            for method, path, headers in (("GET", "/v1/models", fresh), ("GET", "/admin/tenants", admin),
                                          ("GET", "/v1/adapters", fresh), ("GET", "/v1/usage", fresh)):
                started = time.monotonic()
                r = await client.request(method, path, headers=headers)
                assert time.monotonic() - started < 5, path  # the connect timeout, 1 s here, not 60
                assert r.status_code == 503, (path, r.text)
                assert r.json()["error"]["code"] == "database_unavailable" and r.headers["retry-after"], path
    finally:
        proxy.close()


async def test_a_pooled_connection_that_goes_silent_is_given_up_after_the_command_timeout(pg_url):
    """The pool pings a connection before handing it out; on a connection that went silent (a failover that left
    the old address black-holed) the ping waited for TCP to give up, minutes, without a statement timeout."""
    target = urlsplit(pg_url)
    proxy = TcpProxy((target.hostname, target.port or 5432))
    settings = Settings(database_connect_timeout_s=1.0, database_command_timeout_s=1.0)
    engine = make_engine(_through(proxy, pg_url), settings)
    try:
        async with engine.connect() as conn:
            await conn.execute(text("SELECT 1"))  # now pooled
        proxy.freeze()
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            async with engine.connect() as conn:
                await conn.execute(text("SELECT 1"))
        assert time.monotonic() - started < 8  # the ping's timeout, then a new connection's, not minutes
    finally:
        proxy.close()
        await engine.dispose()
