"""A request is billed in the month it ends: one admitted on the last second of a month and still running
at midnight counts against the new month's quota, so the new month never passes its quota on one replica."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from loraplex.platform.auth import Principal
from loraplex.platform.errors import ApiError
from loraplex.platform.usage import plans
from loraplex.platform.usage.quota import QuotaTracker
from loraplex.platform.usage.sink import LedgerSink
from tests.unit.usage.ledger_env import add_tenant, event, migrated

UTC = timezone.utc


async def test_a_request_running_across_midnight_counts_in_the_new_month(tmp_path):
    async with migrated(f"sqlite+aiosqlite:///{tmp_path / 'ledger.db'}") as sessions:
        tid = await add_tenant(sessions, "acme")
        async with sessions() as s:
            await plans.create_plan(s, "small", {"monthly_token_quota": 100})
            await plans.set_tenant_plan(s, "acme", {"plan": "small"})
        sink = LedgerSink(sessions, tmp_path / "spool")
        sink.spool.open()
        now = [datetime(2026, 1, 31, 23, 59, 59, tzinfo=UTC)]
        quota = QuotaTracker(sessions, sink, clock=lambda: now[0])
        sink.on_ingested = quota.on_ingested
        who = Principal(tenant_id=tid, tenant_name="acme", key_id="k", scopes=frozenset({"inference"}))
        late_january = await quota.reserve(who, 100)
        now[0] = datetime(2026, 2, 1, 0, 0, 1, tzinfo=UTC)
        with pytest.raises(ApiError) as err:  # it was admitted as 100 more February tokens before
            await quota.reserve(who, 100)
        assert err.value.code == "insufficient_quota"
        # the January request ends in February: billed there
        await sink.record(event("r1", tid, prompt=50, completion=40, at=datetime(2026, 2, 1, 0, 0, 2, tzinfo=UTC)))
        quota.release(late_january)
        await sink.drain_once()
        assert await quota.used(tid) == 90
        assert (await quota.reserve(who, 10)).tokens == 10  # exactly the quota
        with pytest.raises(ApiError):
            await quota.reserve(who, 1)
        sink.spool.close()
