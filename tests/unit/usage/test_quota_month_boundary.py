"""A request is billed in the month it ends: one admitted on the last second of a month and still running
at midnight counts against the new month's quota, so the new month never passes its quota on one replica."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from loraplex.platform.errors import ApiError
from loraplex.platform.usage.quota import QuotaTracker
from tests.unit.usage.ledger_env import event, migrated, tenant_with_quota

UTC = timezone.utc


async def test_a_request_running_across_midnight_counts_in_the_new_month(tmp_path):
    async with migrated(f"sqlite+aiosqlite:///{tmp_path / 'ledger.db'}") as sessions:
        tid, sink, who = await tenant_with_quota(sessions, tmp_path / "spool")
        now = [datetime(2026, 1, 31, 23, 59, 59, tzinfo=UTC)]
        quota = QuotaTracker(sessions, sink, clock=lambda: now[0])
        sink.on_ingested = quota.on_ingested
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
