"""A burst of requests whose cache entry is missing or expired makes one database read per key (auth and quota),
not one each: 1,000 concurrent requests used to open 1,000 sessions for the same rows and exhaust the pool."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from loraplex.platform import tenants
from loraplex.platform.auth import Authenticator, Principal
from loraplex.platform.db import make_engine, make_session_factory
from loraplex.platform.kv import LocalKV
from loraplex.platform.migrate import upgrade_async
from loraplex.platform.single_flight import SingleFlight
from loraplex.platform.usage import plans
from loraplex.platform.usage.quota import QuotaTracker
from loraplex.platform.usage.sink import LedgerSink


@pytest.fixture
async def counted(tmp_path):
    """A migrated SQLite database, and a session factory that counts the sessions opened."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'db.sqlite'}"
    await upgrade_async(url)
    engine = make_engine(url)
    sessions = make_session_factory(engine)
    opened = [0]

    @contextlib.asynccontextmanager
    async def counting():
        opened[0] += 1
        async with sessions() as s:
            yield s

    yield sessions, counting, opened
    await engine.dispose()


async def test_a_burst_of_one_key_reads_it_once(counted):
    sessions, counting, opened = counted
    async with sessions() as s:
        await tenants.create_tenant(s, "acme")
        _, new = await tenants.create_key(s, "acme")
        _, other = await tenants.create_key(s, "acme")
    auth = Authenticator(counting, LocalKV(), cache_ttl_s=60)
    auth._touch = lambda key_id: None  # last-use writes are sessions of their own, off the request path
    principals = await asyncio.gather(*(auth.authenticate(new.key) for _ in range(200)),
                                      *(auth.authenticate(other.key) for _ in range(50)))
    assert {p.key_id for p in principals} == {new.key_id, other.key_id}
    assert opened[0] == 2  # one read per key id
    # a wrong secret in the same burst still fails, for itself alone
    results = await asyncio.gather(auth.authenticate(new.key), auth.authenticate(new.key[:-1] + "x"),
                                   return_exceptions=True)
    assert results[0].key_id == new.key_id and getattr(results[1], "status_code", None) == 401


async def test_a_burst_of_quota_checks_reads_the_plan_and_the_ledger_once(counted, tmp_path):
    sessions, counting, opened = counted
    async with sessions() as s:
        tenant = await tenants.create_tenant(s, "acme")
        await plans.create_plan(s, "small", {"monthly_token_quota": 1_000_000})
        await plans.set_tenant_plan(s, "acme", {"plan": "small"})
    sink = LedgerSink(sessions, tmp_path / "spool")
    sink.spool.open()
    quota = QuotaTracker(counting, sink)
    who = Principal(tenant_id=tenant.id, tenant_name="acme", key_id="k", scopes=frozenset({"inference"}))
    grants = await asyncio.gather(*(quota.reserve(who, 10) for _ in range(300)))
    assert sum(g.tokens for g in grants) == 3000  # every reservation counted
    assert opened[0] == 2  # the plan once, the month's ledger once
    sink.spool.close()


async def test_one_waiter_cancelled_leaves_the_others_their_answer():
    flights: SingleFlight[int] = SingleFlight()
    release = asyncio.Event()
    calls = []

    async def lookup():
        calls.append(1)
        await release.wait()
        return 7

    first = asyncio.create_task(flights.run("k", lookup))
    second = asyncio.create_task(flights.run("k", lookup))
    await asyncio.sleep(0)
    first.cancel()  # its client went away
    await asyncio.sleep(0)
    release.set()
    assert await second == 7 and len(calls) == 1
    with pytest.raises(asyncio.CancelledError):
        await first
    assert len(flights) == 0


async def test_a_failed_lookup_reaches_every_waiter_and_the_next_call_tries_again():
    flights: SingleFlight[int] = SingleFlight()
    attempts = []

    async def failing():
        attempts.append(1)
        await asyncio.sleep(0)
        raise ConnectionError("database down")

    results = await asyncio.gather(*(flights.run("k", failing) for _ in range(5)), return_exceptions=True)
    assert all(isinstance(r, ConnectionError) for r in results) and len(attempts) == 1

    async def working():
        return 3

    assert await flights.run("k", working) == 3
