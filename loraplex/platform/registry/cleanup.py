"""Housekeeping: uploads a crashed process left behind, and stored content no live version uses.

Deleted versions keep their content for ``grace_s`` (requests already running finish; a replica that has
not heard of the delete yet can still read the files). Content is only collected while no upload is in
flight, and each digest is re-checked right before it goes; an upload that finds its content collected
after all stores it again (service.py), so a race can cost a re-copy, never a broken adapter.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

from sqlalchemy import func, or_, select, update

from loraplex.platform.db import SessionFactory, utcnow
from loraplex.platform.registry.models import (
    STATUS_FAILED,
    STATUS_UPLOADING,
    STATUS_VALIDATING,
    AdapterVersion,
)
from loraplex.platform.registry.store import AdapterStore

log = logging.getLogger(__name__)

IN_FLIGHT = (STATUS_UPLOADING, STATUS_VALIDATING)


async def sweep_interrupted(sessions: SessionFactory, tmp_root: Path, older_than_s: float = 3600.0) -> int:
    """Fail versions stuck in ``uploading``/``validating`` (their process died); remove old temp dirs."""
    cutoff = time.time() - older_than_s
    for entry in tmp_root.iterdir():
        if entry.is_dir() and entry.stat().st_mtime < cutoff:
            await asyncio.to_thread(shutil.rmtree, entry, True)
    async with sessions() as session:
        result = await session.execute(
            update(AdapterVersion)
            .where(AdapterVersion.status.in_(IN_FLIGHT),
                   AdapterVersion.created_at < datetime.fromtimestamp(cutoff, timezone.utc))
            .values(status=STATUS_FAILED, error="interrupted: the server stopped during the upload"))
        await session.commit()
    return result.rowcount or 0


async def _still_needed(sessions: SessionFactory, digest: str, keep_after: datetime) -> bool:
    async with sessions() as session:
        uploads = (await session.execute(
            select(func.count()).select_from(AdapterVersion).where(AdapterVersion.status.in_(IN_FLIGHT)))).scalar()
        users = (await session.execute(
            select(func.count()).select_from(AdapterVersion).where(
                AdapterVersion.digest == digest,
                or_(AdapterVersion.deleted_at.is_(None), AdapterVersion.deleted_at > keep_after)))).scalar()
    return bool(uploads or users)


async def collect_garbage(sessions: SessionFactory, store: AdapterStore, grace_s: float = 3600.0) -> int:
    """Delete stored content that no live version has used for ``grace_s``. Returns how many went."""
    keep_after = utcnow() - timedelta(seconds=grace_s)
    removed = 0
    for digest in await asyncio.to_thread(store.digests):
        if await _still_needed(sessions, digest, keep_after):
            continue
        await asyncio.to_thread(store.delete, digest)
        removed += 1
    if removed:
        log.info("collected %d unused adapter contents", removed)
    return removed


async def run_periodically(sessions: SessionFactory, store: AdapterStore, tmp_root: Path,
                           every_s: float = 600.0, grace_s: float = 3600.0) -> None:
    while True:
        try:
            await sweep_interrupted(sessions, tmp_root, grace_s)
            await collect_garbage(sessions, store, grace_s)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.warning("registry cleanup failed; retrying later", exc_info=True)
        await asyncio.sleep(every_s)
