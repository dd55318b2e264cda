"""Every pooled database connection busy past the pool timeout is a 503 ``database_unavailable`` to retry, not a 500:
SQLAlchemy's pool TimeoutError is not a DBAPI error, so the database handler did not see it."""

from __future__ import annotations

from litestar import Litestar, get
from litestar.testing import AsyncTestClient
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from loraplex.platform.errors import exception_handlers


async def test_an_exhausted_connection_pool_is_a_503_database_unavailable(tmp_path):
    engine = create_async_engine(f"sqlite+aiosqlite:///{tmp_path / 'pool.db'}", pool_size=1, max_overflow=0,
                                 pool_timeout=0.2)

    @get("/busy")
    async def busy() -> str:
        async with engine.connect() as conn:  # the pool's last connection waits for one more
            await conn.execute(text("SELECT 1"))
            async with engine.connect() as second:
                await second.execute(text("SELECT 1"))
        return "unreachable"

    app = Litestar([busy], exception_handlers=exception_handlers())
    try:
        async with AsyncTestClient(app) as client:
            r = await client.get("/busy")
    finally:
        await engine.dispose()
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "database_unavailable" and "busy" in r.json()["error"]["message"]
    assert r.headers["retry-after"]
