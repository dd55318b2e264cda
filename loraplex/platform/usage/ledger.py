"""The ledger: one row per request, keyed by ``request_id``. Writes are idempotent
(``INSERT ... ON CONFLICT (request_id) DO NOTHING``), so delivering an event twice is harmless."""

from __future__ import annotations

import logging
from datetime import datetime, timezone

from sqlalchemy import String, func, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from loraplex.platform.db import SessionFactory, utcnow
from loraplex.platform.hooks import UsageEvent
from loraplex.platform.usage.models import UsageRecord

log = logging.getLogger(__name__)

# 19 columns per row: stays far below SQLite's and asyncpg's bound-parameter limits
INSERT_BATCH = 500
_COLUMNS = (
    "request_id", "tenant_id", "tenant_name", "key_id", "model", "endpoint", "adapter_id", "adapter_version",
    "adapter_name", "prompt_tokens", "cached_prompt_tokens", "completion_tokens", "status", "finish_reason",
    "queue_s", "ttft_s", "total_s", "created_at",
)


def event_record(event: UsageEvent) -> dict:
    """What goes into the spool: JSON-safe, one line."""
    out = {c: getattr(event, c) for c in _COLUMNS if c != "created_at"}
    out["created_at"] = as_utc(event.created_at).isoformat()
    return out


def as_utc(value: datetime) -> datetime:
    return value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value.astimezone(timezone.utc)


def _text_limits() -> dict[str, int]:
    return {c.name: c.type.length for c in UsageRecord.__table__.columns
            if isinstance(c.type, String) and c.type.length and c.name in _COLUMNS}


_TEXT_LIMITS = _text_limits()
_REQUIRED_TEXT = ("tenant_id", "tenant_name", "key_id", "model", "endpoint", "status")


def record_row(record: dict) -> dict:
    """A spool record -> ledger row values. Never fails on a value the table cannot hold (a text too
    long, a missing field): one odd record must not block every later one behind it in the spool."""
    row = {c: record.get(c) for c in _COLUMNS}
    if not isinstance(row["request_id"], str) or not row["request_id"]:
        raise ValueError("a usage record needs a request_id")
    row["created_at"] = as_utc(datetime.fromisoformat(record["created_at"]))
    for c in ("prompt_tokens", "cached_prompt_tokens", "completion_tokens"):
        row[c] = max(0, int(row[c] or 0))
    if row["cached_prompt_tokens"] > row["prompt_tokens"]:
        # cached tokens are a part of the prompt's (pricing counts on it: one such row would fail every export over
        # its window); kept as the whole prompt cached, and said, as it is an accounting fault upstream
        log.warning("usage record %s: %d cached prompt tokens of %d prompt tokens; stored as %d cached",
                    row["request_id"], row["cached_prompt_tokens"], row["prompt_tokens"], row["prompt_tokens"])
        row["cached_prompt_tokens"] = row["prompt_tokens"]
    row["total_s"] = float(row["total_s"] or 0.0)
    for c in _REQUIRED_TEXT:
        row[c] = "" if row[c] is None else row[c]
    for c, limit in _TEXT_LIMITS.items():
        if isinstance(row[c], str) and len(row[c]) > limit:
            row[c] = row[c][:limit]
    return row


def billable_tokens(record: dict) -> int:
    return int(record.get("prompt_tokens") or 0) + int(record.get("completion_tokens") or 0)


async def insert_records(sessions: SessionFactory, records: list[dict]) -> set[str]:
    """Write records; returns the request ids that were *new* (the rest were already in the ledger)."""
    unique: dict[str, dict] = {}
    rows = []
    for r in records:
        if r.get("request_id") in unique:
            continue  # the first delivery wins; the others are the same event
        try:
            rows.append(record_row(r))
        except (KeyError, TypeError, ValueError):
            log.error("usage record cannot be stored and is skipped: %s", r)  # never blocks the rest
            continue
        unique[r["request_id"]] = r
    if not rows:
        return set()
    now = utcnow()
    for row in rows:
        row["recorded_at"] = now
    inserted: set[str] = set()
    async with sessions() as session:
        insert = pg_insert if session.bind.dialect.name == "postgresql" else sqlite_insert
        for i in range(0, len(rows), INSERT_BATCH):
            stmt = (
                insert(UsageRecord).values(rows[i:i + INSERT_BATCH])
                .on_conflict_do_nothing(index_elements=["request_id"])
                .returning(UsageRecord.request_id)
            )
            inserted.update((await session.execute(stmt)).scalars())
        await session.commit()
    return inserted


async def tokens_used(sessions: SessionFactory, tenant_id: str, start: datetime, end: datetime) -> int:
    """prompt + completion tokens of ``tenant_id`` recorded with ``start <= created_at < end``."""
    async with sessions() as session:
        total = await session.scalar(
            select(func.coalesce(func.sum(UsageRecord.prompt_tokens + UsageRecord.completion_tokens), 0))
            .where(UsageRecord.tenant_id == tenant_id, UsageRecord.created_at >= start, UsageRecord.created_at < end)
        )
    return int(total or 0)
