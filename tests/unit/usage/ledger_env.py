"""A migrated database (SQLite file, or a fresh PostgreSQL database) with a tenant, for ledger tests."""

from __future__ import annotations

import contextlib
from datetime import datetime, timezone

from loraplex.platform.db import make_engine, make_session_factory
from loraplex.platform.hooks import UsageEvent
from loraplex.platform.migrate import upgrade_async
from loraplex.platform.tenants import create_tenant


@contextlib.asynccontextmanager
async def migrated(url: str):
    await upgrade_async(url)
    db = make_engine(url)
    try:
        yield make_session_factory(db)
    finally:
        await db.dispose()


async def add_tenant(sessions, name: str) -> str:
    async with sessions() as s:
        return (await create_tenant(s, name)).id


def event(rid: str, tenant_id: str, *, prompt: int = 10, cached: int = 0, completion: int = 5,
          at: datetime | None = None, adapter_id: str | None = None, key_id: str = "k1",
          status: str = "completed") -> UsageEvent:
    return UsageEvent(
        request_id=rid, tenant_id=tenant_id, tenant_name="t-" + tenant_id[:6], key_id=key_id, model="m",
        endpoint="completions", prompt_tokens=prompt, cached_prompt_tokens=cached, completion_tokens=completion,
        status=status, adapter_id=adapter_id, adapter_version=1 if adapter_id else None, total_s=0.1,
        created_at=at or datetime.now(timezone.utc),
    )


async def tenant_with_quota(sessions, spool_dir, quota: int = 100):
    """(tenant id, an opened ledger sink, a principal of its key): tenant "acme" on plan "small" with a monthly token
    quota of ``quota``, for the quota tests (each builds its own QuotaTracker over them)."""
    from loraplex.platform.auth import Principal
    from loraplex.platform.usage import plans
    from loraplex.platform.usage.sink import LedgerSink

    tid = await add_tenant(sessions, "acme")
    async with sessions() as s:
        await plans.create_plan(s, "small", {"monthly_token_quota": quota})
        await plans.set_tenant_plan(s, "acme", {"plan": "small"})
    sink = LedgerSink(sessions, spool_dir)
    sink.spool.open()
    who = Principal(tenant_id=tid, tenant_name="acme", key_id="k", scopes=frozenset({"inference"}))
    return tid, sink, who
