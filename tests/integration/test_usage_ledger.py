"""The spool -> ledger path on SQLite and PostgreSQL: exactly one row per request whatever is delivered
twice or replayed, nothing lost while the database is down, month boundaries, export windows, prices
and quotas."""

from __future__ import annotations

import shutil
from datetime import datetime, timedelta, timezone
from decimal import Decimal

import pytest
from sqlalchemy import func, select

from loraplex.platform.errors import ApiError
from loraplex.platform.registry.models import Adapter
from loraplex.platform.usage import aggregate, plans
from loraplex.platform.usage.models import UsageRecord
from loraplex.platform.usage.quota import QuotaTracker
from loraplex.platform.usage.sink import LedgerSink
from loraplex.platform.usage.spool import list_segments
from tests.unit.usage.ledger_env import add_tenant, event, migrated, tenant_with_quota

UTC = timezone.utc


@pytest.fixture
def bad_url(db_url, tmp_path):
    """The same kind of database, unreachable."""
    if db_url.startswith("sqlite"):
        return f"sqlite+aiosqlite:///{tmp_path / 'missing-dir' / 'x.db'}"
    return "postgresql+asyncpg://postgres@127.0.0.1:1/nowhere"


async def _rows(sessions) -> dict[str, UsageRecord]:
    async with sessions() as s:
        return {r.request_id: r for r in (await s.scalars(select(UsageRecord))).all()}


async def test_same_event_delivered_three_times_is_one_row(db_url, tmp_path):
    async with migrated(db_url) as sessions:
        tid = await add_tenant(sessions, "acme")
        seen = []
        sink = LedgerSink(sessions, tmp_path / "spool", on_ingested=seen.extend)
        sink.spool.open()
        ev = event("req-1", tid, prompt=12, cached=4, completion=7)
        for _ in range(3):
            await sink.record(ev)
        assert await sink.drain_once() == 1
        for _ in range(3):  # and three more deliveries, each in a batch of its own
            await sink.record(ev)
            await sink.drain_once()
        rows = await _rows(sessions)
        assert list(rows) == ["req-1"]
        r = rows["req-1"]
        assert (r.prompt_tokens, r.cached_prompt_tokens, r.completion_tokens, r.tenant_id) == (12, 4, 7, tid)
        assert [x["request_id"] for x in seen] == ["req-1"]  # quotas counted it once
        assert not sink.pending and list_segments(sink.spool.directory) == []
        sink.spool.close()


async def test_concurrent_drains_take_each_segment_once(db_url, tmp_path):
    """The background consumer and an explicit drain (shutdown, a test settling, the replay command) may overlap:
    each closed segment is ingested and acked by one of them, never both (a second unlink failed before)."""
    import asyncio

    async with migrated(db_url) as sessions:
        tid = await add_tenant(sessions, "acme")
        sink = LedgerSink(sessions, tmp_path / "spool")
        sink.spool.open()
        for batch in range(4):
            for i in range(20):
                await sink.record(event(f"b{batch}-r{i}", tid, completion=i))
            await sink.spool.rotate()
        written = await asyncio.gather(*(sink.drain_once() for _ in range(3)))
        assert sum(written) == 80
        assert len(await _rows(sessions)) == 80 and list_segments(sink.spool.directory) == []
        sink.spool.close()


async def test_consumer_crash_before_ack_replays_into_one_row(db_url, tmp_path):
    async with migrated(db_url) as sessions:
        tid = await add_tenant(sessions, "acme")
        sink = LedgerSink(sessions, tmp_path / "spool")
        sink.spool.open()
        for i in range(50):
            await sink.record(event(f"r{i}", tid, completion=i))
        await sink.spool.rotate()
        (segment,) = sink.spool.closed_segments()
        shutil.copy(segment, tmp_path / "copy")
        await sink.drain_once()  # committed and acked (segment deleted) ...
        shutil.copy(tmp_path / "copy", segment)  # ... but the crash came before the delete hit the disk
        sink.spool.close()

        seen = []
        restarted = LedgerSink(sessions, tmp_path / "spool", on_ingested=seen.extend)
        await restarted.start()
        await restarted.stop()
        rows = await _rows(sessions)
        assert sorted(rows) == sorted(f"r{i}" for i in range(50))
        assert sum(r.completion_tokens for r in rows.values()) == sum(range(50))
        assert seen == []  # the replay found nothing new
        assert list_segments(tmp_path / "spool" / "main") == []


async def test_database_down_usage_is_spooled_not_lost(db_url, bad_url, tmp_path):
    async with migrated(db_url) as good, migrated(db_url) as _:
        tid = await add_tenant(good, "acme")
        from loraplex.platform.db import make_engine, make_session_factory

        down = make_engine(bad_url)
        sink = LedgerSink(make_session_factory(down), tmp_path / "spool", interval_s=0.05)
        await sink.start(initial_drain_timeout_s=5)
        for i in range(5):
            await sink.record(event(f"d{i}", tid))  # returns: durable in the spool
        with pytest.raises(Exception):  # noqa: B017 (whatever the driver raises for "unreachable")
            await sink.drain_once()
        assert len(sink.pending) == 5 and sink.spool.closed_segments()
        assert sink.pending_tokens(tid, datetime(2000, 1, 1, tzinfo=UTC), datetime(3000, 1, 1, tzinfo=UTC)) == 75
        assert not await sink.wait_ingested_before(datetime.now(UTC) + timedelta(seconds=1), 0.3)
        # a crash now would keep the spool; here the database comes back and the consumer catches up
        sink.sessions = good
        assert await sink.wait_ingested_before(datetime.now(UTC) + timedelta(seconds=1), 40)
        await sink.stop()
        await down.dispose()
        assert sorted(await _rows(good)) == [f"d{i}" for i in range(5)]


async def test_month_boundary_splits_exports_and_quota(db_url, tmp_path):
    async with migrated(db_url) as sessions:
        tid = await add_tenant(sessions, "acme")
        sink = LedgerSink(sessions, tmp_path / "spool")
        sink.spool.open()
        jan_last = datetime(2026, 1, 31, 23, 59, 59, 999999, tzinfo=UTC)
        feb_first = datetime(2026, 2, 1, tzinfo=UTC)
        await sink.record(event("jan-a", tid, prompt=100, completion=1, at=jan_last))
        await sink.record(event("jan-b", tid, prompt=10, completion=1, at=datetime(2026, 1, 1, tzinfo=UTC)))
        await sink.record(event("feb-a", tid, prompt=1000, completion=1, at=feb_first))
        await sink.drain_once()

        async def totals(start, end, group_by="day"):
            return [r async for r in aggregate.rows(sessions, aggregate.Query(start, end, group_by))]

        jan = await totals(datetime(2026, 1, 1, tzinfo=UTC), feb_first)
        feb = await totals(feb_first, datetime(2026, 3, 1, tzinfo=UTC))
        assert [(r["day"], r["prompt_tokens"]) for r in jan] == [("2026-01-01", 10), ("2026-01-31", 100)]
        assert [(r["day"], r["prompt_tokens"]) for r in feb] == [("2026-02-01", 1000)]
        # a naive/offset window edge means the same instant in UTC
        late = await totals(aggregate.parse_time("2026-02-01T01:00:00+01:00", "from"), datetime(2026, 3, 1, tzinfo=UTC))
        assert sum(r["requests"] for r in late) == 1

        q = QuotaTracker(sessions, sink, clock=lambda: datetime(2026, 1, 15, tzinfo=UTC))
        assert await q.used(tid) == 112
        q.clock = lambda: datetime(2026, 2, 15, tzinfo=UTC)
        assert await q.used(tid) == 1001
        sink.spool.close()


async def test_export_windows_partition_requests(db_url, tmp_path):
    import random

    async with migrated(db_url) as sessions:
        tids = [await add_tenant(sessions, n) for n in ("acme", "globex")]
        sink = LedgerSink(sessions, tmp_path / "spool")
        sink.spool.open()
        rng = random.Random(5)
        base = datetime(2026, 5, 31, 23, 0, tzinfo=UTC)
        total = 0
        for i in range(300):
            at = base + timedelta(microseconds=rng.randrange(2 * 3600 * 10**6))
            completion = rng.randrange(50)
            total += completion
            await sink.record(event(f"w{i}", rng.choice(tids), completion=completion, at=at,
                                    adapter_id=rng.choice([None, "a1", "a2"]), key_id=rng.choice(["k1", "k2"])))
        await sink.drain_once()
        cuts = sorted(base + timedelta(microseconds=rng.randrange(2 * 3600 * 10**6)) for _ in range(6))
        edges = [base, *cuts, base + timedelta(hours=2)]
        for group_by in aggregate.GROUP_BY:
            requests = completion_sum = 0
            for lo, hi in zip(edges, edges[1:]):
                async for r in aggregate.rows(sessions, aggregate.Query(lo, hi, group_by)):
                    requests += r["requests"]
                    completion_sum += r["completion_tokens"]
            assert (requests, completion_sum) == (300, total), group_by
        sink.spool.close()


async def test_export_costs_use_each_tenants_plan_and_adapter_surcharges(db_url, tmp_path):
    async with migrated(db_url) as sessions:
        acme, globex = await add_tenant(sessions, "acme"), await add_tenant(sessions, "globex")
        async with sessions() as s:
            s.add(Adapter(id="a1", tenant_id=acme, name="a1"))  # surcharges name adapters that exist
            await s.commit()
            await plans.create_plan(s, "pro", {"input_per_mtok": "0.1", "cached_input_per_mtok": "0.05",
                                               "output_per_mtok": "0.3", "adapter_surcharges": {"*": "0.01", "a1": 1}})
            await plans.set_tenant_plan(s, "acme", {"plan": "pro"})
        sink = LedgerSink(sessions, tmp_path / "spool")
        sink.spool.open()
        at = datetime(2026, 3, 3, tzinfo=UTC)
        await sink.record(event("c1", acme, prompt=1_000_000, cached=200_000, completion=1_000_000, at=at))
        await sink.record(event("c2", acme, prompt=3, cached=0, completion=3, at=at, adapter_id="a1"))
        await sink.record(event("c3", acme, prompt=1, cached=0, completion=0, at=at, adapter_id="a2"))
        await sink.record(event("c4", globex, prompt=10**6, completion=10**6, at=at))  # no plan: free
        await sink.drain_once()
        rows = [r async for r in aggregate.rows(sessions, aggregate.Query(at, at + timedelta(days=1), "day"))]
        by_tenant = {r["tenant_id"]: r for r in rows}
        # c1: 800k uncached x 0.1 + 200k cached x 0.05 + 1M out x 0.3           = 0.39
        # c2: (3 x 0.1 + 3 x 0.3 + 6 tokens x a1's 1) / 1M                     = 0.0000072
        # c3: (1 x 0.1 + 1 token x the "*" 0.01) / 1M                          = 0.00000011
        assert Decimal(by_tenant[acme]["cost"]) == Decimal("0.39") + Decimal("0.0000072") + Decimal("0.00000011")
        assert by_tenant[acme]["cost"] == "0.39000731"  # exact text, no float noise
        assert by_tenant[globex]["cost"] == "0.00"
        sink.spool.close()


async def test_quota_counts_ledger_pending_and_reservations(db_url, tmp_path):
    async with migrated(db_url) as sessions:
        tid, sink, who = await tenant_with_quota(sessions, tmp_path / "spool")
        quota = QuotaTracker(sessions, sink)
        sink.on_ingested = quota.on_ingested
        await sink.record(event("q1", tid, prompt=20, completion=10))  # pending: 30
        first = await quota.reserve(who, 50)  # 30 + 50 <= 100
        with pytest.raises(ApiError) as err:
            await quota.reserve(who, 21)  # 30 + 50 + 21 > 100
        assert err.value.status_code == 429 and err.value.code == "insufficient_quota"
        assert err.value.headers["x-should-retry"] == "false"
        # a request on the default budget (no max_tokens) is granted what is left, down to its least
        with pytest.raises(ApiError, match="at least 21 tokens .* only 20 of the monthly quota"):
            await quota.reserve(who, 256, at_least=21)
        cut = await quota.reserve(who, 256, at_least=12)
        assert cut.tokens == 20  # 30 + 50 + 20 = 100: exactly the quota
        quota.release(cut)
        await sink.drain_once()  # pending -> ledger: the same 30 tokens, counted once
        assert await quota.used(tid) == 30
        quota.release(first)
        assert await quota.reserve(who, 70) is not None
        # an override on the tenant beats the plan's quota (after the admin change invalidates the cache)
        async with sessions() as s:
            await plans.set_tenant_plan(s, "acme", {"monthly_token_quota": 10})
        quota.invalidate(tid)
        with pytest.raises(ApiError, match="exceeded your monthly token quota"):
            await quota.reserve(who, 1)
        sink.spool.close()
        async with sessions() as s:
            assert await s.scalar(select(func.count()).select_from(UsageRecord)) == 1


async def test_quota_with_database_down_uses_last_known_values_else_503(db_url, bad_url, tmp_path):
    from loraplex.platform.db import make_engine, make_session_factory

    async with migrated(db_url) as sessions:
        tid, sink, who = await tenant_with_quota(sessions, tmp_path / "spool")
        quota = QuotaTracker(sessions, sink, ledger_ttl_s=0, plan_ttl_s=0)  # every call asks the database
        await sink.record(event("q1", tid, prompt=60, completion=0))
        await sink.drain_once()
        assert await quota.reserve(who, 40) is not None
        down = make_engine(bad_url)
        quota.sessions = make_session_factory(down)
        with pytest.raises(ApiError) as err:  # the last known state still says 60 used + 40 reserved
            await quota.reserve(who, 1)
        assert err.value.code == "insufficient_quota"
        fresh = QuotaTracker(make_session_factory(down), sink)
        with pytest.raises(ApiError) as err:
            await fresh.reserve(who, 1)
        assert err.value.status_code == 503 and err.value.code == "quota_unavailable"
        await down.dispose()
        sink.spool.close()


async def test_disk_failure_keeps_events_in_memory_until_the_ledger_has_them(db_url, tmp_path):
    import os

    async with migrated(db_url) as sessions:
        tid = await add_tenant(sessions, "acme")
        sink = LedgerSink(sessions, tmp_path / "spool")
        sink.spool.open()
        await sink.record(event("s1", tid))
        read_only = os.open(os.devnull, os.O_RDONLY)  # the disk "fails": writes to the segment raise EBADF
        os.dup2(read_only, sink.spool._fd)
        os.close(read_only)
        await sink.record(event("s2", tid))  # never raises to the request
        assert [r["request_id"] for r in sink._memory_backlog] == ["s2"]
        await sink.record(event("s3", tid))  # the spool recovered with a new segment
        await sink.drain_once()
        assert sorted(await _rows(sessions)) == ["s1", "s2", "s3"] and not sink.pending
        sink.spool.close()


async def test_an_odd_record_never_blocks_the_ones_behind_it(db_url, tmp_path):
    from dataclasses import replace

    async with migrated(db_url) as sessions:
        tid = await add_tenant(sessions, "acme")
        sink = LedgerSink(sessions, tmp_path / "spool")
        sink.spool.open()
        await sink.record(replace(event("odd", tid), model="m" * 5000, adapter_name="a" * 999, finish_reason="x" * 99))
        await sink.spool.append({"request_id": "broken"})  # valid JSON, not a usage event: logged, skipped
        # more cached than prompt tokens (an accounting fault upstream): pricing it failed every export of its window
        await sink.record(event("overcached", tid, prompt=10, cached=12, completion=3))
        await sink.record(event("next", tid))
        await sink.drain_once()
        rows = await _rows(sessions)
        assert sorted(rows) == ["next", "odd", "overcached"] and len(rows["odd"].model) == 256
        assert (rows["overcached"].prompt_tokens, rows["overcached"].cached_prompt_tokens) == (10, 10)
        start = datetime.now(UTC) - timedelta(days=1)
        exported = [r async for r in aggregate.rows(sessions, aggregate.Query(start, start + timedelta(days=2),
                                                                              "day"))]
        assert [r["requests"] for r in exported] == [3]
        assert sink.spool.closed_segments() == []
        sink.spool.close()


async def test_shutdown_while_the_consumer_writes_lands_every_event_in_the_ledger(tmp_path, caplog):
    """SIGTERM while the consumer is inside a ledger write (here it waits for SQLite's write lock, which another
    writer such as the admin CLI holds for a moment): stop() lets that write finish. Cancelled inside it, the
    write's connection kept the lock, the final drain waited out the 30 s busy timeout, and the last requests'
    events were left in the spool: the ledger missed them (``bench all`` counted 8 of 12 after a SIGTERM)."""
    import asyncio
    import sqlite3
    import time

    db = tmp_path / "ledger.db"
    async with migrated(f"sqlite+aiosqlite:///{db}") as sessions:
        tid = await add_tenant(sessions, "acme")
        sink = LedgerSink(sessions, tmp_path / "spool", interval_s=0.05)
        await sink.start()
        other = sqlite3.connect(db, isolation_level=None)
        other.execute("BEGIN IMMEDIATE")
        for i in range(4):
            await sink.record(event(f"last-{i}", tid))
        deadline = time.monotonic() + 10
        while not sink.spool.closed_segments():  # the consumer rotated the segment and is ingesting it
            assert time.monotonic() < deadline, "the consumer never took the segment"
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)  # its INSERT waits for the lock
        asyncio.get_running_loop().call_later(0.3, other.execute, "COMMIT")
        started = time.monotonic()
        await sink.stop()
        other.close()
        assert sorted(await _rows(sessions)) == [f"last-{i}" for i in range(4)]
        assert time.monotonic() - started < 5
        assert not sink.pending and list_segments(sink.spool.directory) == []
        assert "incomplete" not in caplog.text


async def test_a_restart_with_the_database_down_keeps_the_spool_it_found_pending(db_url, bad_url, tmp_path):
    """A server killed while the database was down restarts with events in its spool and the database still down:
    those events are pending like its own. Before, only events recorded since the restart were: exports said
    ``x-usage-complete: true`` without them, and quotas did not count them, until the consumer's next try (up to
    30 s after the database came back)."""
    from loraplex.platform.db import make_engine, make_session_factory

    async with migrated(db_url) as good:
        tid = await add_tenant(good, "acme")
        down = make_engine(bad_url)
        killed = LedgerSink(make_session_factory(down), tmp_path / "spool")
        killed.spool.open()
        for i in range(3):
            await killed.record(event(f"k{i}", tid, prompt=10, completion=5))
        killed.spool.close()  # SIGKILL: nothing reached the ledger

        restarted = LedgerSink(make_session_factory(down), tmp_path / "spool", interval_s=0.05)
        await restarted.start(initial_drain_timeout_s=5)
        now = datetime.now(UTC)
        assert not await restarted.wait_ingested_before(now + timedelta(seconds=1), 0.3)
        month = (datetime(now.year, now.month, 1, tzinfo=UTC), datetime(now.year + 1, 1, 1, tzinfo=UTC))
        assert restarted.pending_tokens(tid, *month) == 45
        restarted.sessions = good  # the database is back
        assert await restarted.wait_ingested_before(now + timedelta(seconds=1), 40)
        assert restarted.pending_tokens(tid, *month) == 0
        await restarted.stop()
        await down.dispose()
        assert sorted(await _rows(good)) == ["k0", "k1", "k2"]
