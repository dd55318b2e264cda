"""Migration 0004 (shares by tenant name) keeps every existing share, on SQLite and PostgreSQL, and its
downgrade keeps the shares whose tenant exists."""

from __future__ import annotations

import asyncio

import sqlalchemy as sa

from loraplex.platform.db import make_engine
from loraplex.platform.migrate import alembic_config, upgrade_async


async def _sql(url: str, *statements: str) -> list:
    engine = make_engine(url)
    try:
        async with engine.begin() as conn:
            out = []
            for stmt in statements:
                result = await conn.execute(sa.text(stmt))
                out = [tuple(r) for r in result] if result.returns_rows else out
            return out
    finally:
        await engine.dispose()


async def test_shares_survive_the_move_to_tenant_names(db_url):
    await upgrade_async(db_url, "0003_usage")
    now = "'2026-01-01 00:00:00'"
    await _sql(db_url, *(f"INSERT INTO tenants (id, name, status, created_at) VALUES ('{i * 32}', '{n}', 'active', {now})"
                         for i, n in (("a", "alice"), ("b", "bob"), ("c", "carol"))),
               f"INSERT INTO adapters (id, tenant_id, name, visibility, created_at, updated_at) "
               f"VALUES ('{'d' * 32}', '{'a' * 32}', 'tuned', 'shared', {now}, {now})",
               f"INSERT INTO adapter_shares (adapter_id, tenant_id) VALUES ('{'d' * 32}', '{'b' * 32}'), "
               f"('{'d' * 32}', '{'c' * 32}')")
    await upgrade_async(db_url)
    assert await _sql(db_url, "SELECT adapter_id, tenant_name FROM adapter_shares ORDER BY tenant_name") == \
        [("d" * 32, "bob"), ("d" * 32, "carol")]
    await _sql(db_url, f"INSERT INTO adapter_shares (adapter_id, tenant_name) VALUES ('{'d' * 32}', 'ghost')")

    from alembic import command

    await asyncio.to_thread(command.downgrade, alembic_config(db_url), "0003_usage")
    assert await _sql(db_url, "SELECT adapter_id, tenant_id FROM adapter_shares ORDER BY tenant_id") == \
        [("d" * 32, "b" * 32), ("d" * 32, "c" * 32)]  # 'ghost' names no tenant: nothing to keep
