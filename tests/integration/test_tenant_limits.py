"""Tenant rate limits at the edge of what the database stores: the same answer on SQLite and PostgreSQL.

The columns are 32-bit integers on PostgreSQL. A larger limit used to be a 500 on the embedded default
(SQLite's OverflowError), a 400 that named no field on PostgreSQL (and 10 billion tokens/min was stored on
SQLite but refused on PostgreSQL); now both refuse it with the field and the limit named.
"""

from __future__ import annotations

import pytest

from loraplex.platform import tenants
from loraplex.platform.db import make_engine, make_session_factory
from loraplex.platform.errors import ApiError
from loraplex.platform.kv import LocalKV
from loraplex.platform.migrate import upgrade_async

MAX_LIMIT = 2**31 - 1


@pytest.fixture
async def sessions(db_url):
    await upgrade_async(db_url)
    engine = make_engine(db_url)
    try:
        yield make_session_factory(engine)
    finally:
        await engine.dispose()


@pytest.mark.parametrize("field", ["requests_per_minute", "tokens_per_minute"])
@pytest.mark.parametrize("value", [MAX_LIMIT + 1, 10**10, 10**20])
async def test_a_limit_over_the_column_is_a_400_naming_it(sessions, field, value):
    async with sessions() as s:
        with pytest.raises(ApiError) as err:
            await tenants.create_tenant(s, "acme", **{field: value})
    assert err.value.status_code == 400 and err.value.param == field
    assert str(MAX_LIMIT) in err.value.message
    async with sessions() as s:
        assert [t.name for t in await tenants.list_tenants(s)] == []  # nothing half-created

    async with sessions() as s:
        await tenants.create_tenant(s, "acme", requests_per_minute=7, tokens_per_minute=70)
    async with sessions() as s:
        with pytest.raises(ApiError) as err:
            await tenants.update_tenant_limits(s, LocalKV(), "acme", **{"requests_per_minute": None,
                                                                          "tokens_per_minute": None, field: value})
    assert err.value.status_code == 400 and err.value.param == field
    async with sessions() as s:
        t = await tenants.get_tenant(s, "acme")
        assert (t.requests_per_minute, t.tokens_per_minute) == (7, 70)  # unchanged


async def test_the_largest_limit_is_stored_on_both_backends(sessions):
    async with sessions() as s:
        await tenants.create_tenant(s, "acme", requests_per_minute=MAX_LIMIT, tokens_per_minute=MAX_LIMIT)
    async with sessions() as s:
        t = await tenants.get_tenant(s, "acme")
        assert (t.requests_per_minute, t.tokens_per_minute) == (MAX_LIMIT, MAX_LIMIT)
