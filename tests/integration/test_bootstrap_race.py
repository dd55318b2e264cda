"""Replicas starting together on an empty database issue exactly one bootstrap admin key, on SQLite and
PostgreSQL: several engines (one per replica, each its own connection pool) run ``bootstrap_admin`` at once."""

from __future__ import annotations

import asyncio

import sqlalchemy as sa

from loraplex.platform.db import make_engine, make_session_factory
from loraplex.platform.migrate import upgrade_async
from loraplex.platform.models import SCOPE_ADMIN, ApiKey
from loraplex.platform.tenants import ADMIN_TENANT, bootstrap_admin

NUM_REPLICAS = 6
NUM_ROUNDS = 15


async def _start_together(engines) -> list[str | None]:
    async def replica(engine) -> str | None:
        async with make_session_factory(engine)() as session:
            return await bootstrap_admin(session)

    return await asyncio.gather(*(replica(e) for e in engines))


async def test_replicas_starting_together_issue_one_admin_key(db_url):
    await upgrade_async(db_url)
    engines = [make_engine(db_url) for _ in range(NUM_REPLICAS)]
    try:
        for round_ in range(NUM_ROUNDS):
            async with engines[0].begin() as conn:  # an empty database again
                await conn.execute(sa.text("DELETE FROM api_keys"))
                await conn.execute(sa.text("DELETE FROM tenants"))
            shown = [k for k in await _start_together(engines) if k is not None]
            async with engines[0].connect() as conn:
                rows = (await conn.execute(sa.select(ApiKey.scopes))).all()
                tenant_names = (await conn.execute(sa.text("SELECT name FROM tenants"))).scalars().all()
            assert len(shown) == 1, f"round {round_}: {len(shown)} replicas printed a bootstrap key"
            assert [tuple(scopes) for (scopes,) in rows] == [(SCOPE_ADMIN,)], f"round {round_}: {rows}"
            assert tenant_names == [ADMIN_TENANT]
            # a later start (keys exist) prints nothing
            assert await _start_together(engines[:2]) == [None, None]
    finally:
        for e in engines:
            await e.dispose()
