"""The usage sink the inference route calls once per request, and the consumer that fills the ledger.

``record`` appends the event to the local spool and returns after ``fsync`` (the route waits for it
before the client sees the end of its response, so a finished request is never lost to a crash). A
background consumer moves closed spool segments into the ledger with ``ON CONFLICT DO NOTHING`` and
deletes a segment only after the commit: at-least-once delivery into an idempotent ledger, i.e.
exactly-once rows. With the database down, segments wait on disk and the consumer retries with
backoff; with the disk failing too, events wait in memory (logged) until one of them works again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

from loraplex.platform.db import SessionFactory
from loraplex.platform.hooks import UsageEvent
from loraplex.platform.usage.ledger import as_utc, billable_tokens, event_record, insert_records
from loraplex.platform.usage.spool import Spool, list_segments, read_segment, unlock

log = logging.getLogger(__name__)

DRAIN_INTERVAL_S = 0.2
ORPHAN_SCAN_S = 30.0
MAX_BACKOFF_S = 30.0


class LedgerSink:
    def __init__(self, sessions: SessionFactory, spool_dir: Path, *, interval_s: float = DRAIN_INTERVAL_S,
                 fsync: bool = True, on_ingested: Callable[[list[dict]], None] | None = None):
        self.sessions = sessions
        self.spool = Spool(spool_dir, fsync=fsync)
        self.interval_s = interval_s
        self.on_ingested = on_ingested  # called with the records that were new to the ledger
        # request_id -> (record, created_at): accepted by record() and not yet committed to the ledger
        self.pending: dict[str, tuple[dict, datetime]] = {}
        self._memory_backlog: list[dict] = []  # spool write failed; kept here until the ledger takes them
        self._task: asyncio.Task | None = None
        self._wake = asyncio.Event()
        self._drained = asyncio.Condition()
        self._drain_lock = asyncio.Lock()  # one drain at a time: two would ingest and ack the same segment
        self._last_orphan_scan = float("-inf")
        self.failures = 0

    # ---- UsageSink ----------------------------------------------------------------------------------

    async def record(self, event: UsageEvent) -> None:
        rec = event_record(event)
        # before any await: from here on exports and quotas see it (pending, then ledger)
        self.pending[rec["request_id"]] = (rec, as_utc(event.created_at))
        try:
            await self.spool.append(rec)
        except Exception:
            log.exception("usage spool write failed for %s; keeping it in memory until the ledger takes it",
                          rec["request_id"])
            self._memory_backlog.append(rec)
            self._wake.set()

    # ---- lifecycle ----------------------------------------------------------------------------------

    async def start(self, initial_drain_timeout_s: float = 10.0) -> None:
        self.spool.open()
        self._track_spooled()
        try:  # replay what a previous run left, before traffic (bounded: the database may be down)
            await asyncio.wait_for(self.drain_once(include_orphans=True), initial_drain_timeout_s)
        except Exception as exc:
            log.warning("usage replay at start did not finish (%s); the consumer keeps trying", exc)
        self._task = asyncio.create_task(self._run(), name="usage-consumer")

    def _track_spooled(self) -> None:
        """What a previous run left in this spool is pending like the events recorded since: until the ledger has
        it (the database may still be down), exports are not complete and quotas count it."""
        for segment in self.spool.closed_segments():
            for rec in read_segment(segment):
                try:
                    self.pending[rec["request_id"]] = (rec, as_utc(datetime.fromisoformat(rec["created_at"])))
                except (KeyError, TypeError, ValueError):
                    continue  # not a usage event: the ledger write logs and skips it

    async def stop(self, timeout_s: float = 10.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        if self._task is not None:
            await self._stop_consumer(timeout_s)
        try:
            await asyncio.wait_for(self.drain_once(), max(0.0, deadline - loop.time()))
        except Exception as exc:  # whatever is left stays in the spool for the next start
            log.warning("usage drain at shutdown incomplete (%s: %s); the spool keeps the rest",
                        type(exc).__name__, exc)
        if self._memory_backlog:
            log.error("usage events lost at shutdown (spool and ledger both failed): %s", self._memory_backlog)
        self.spool.close()

    async def _stop_consumer(self, timeout_s: float) -> None:
        """Cancel the consumer between drains, never inside one. A drain cancelled inside its ledger write
        leaves that connection holding SQLite's write lock (the driver's thread runs the statement on, and the
        transaction is never ended): the final drain then waited out the busy timeout (30 s) and the last
        requests' events stayed in the spool instead of the ledger."""
        try:
            await asyncio.wait_for(self._drain_lock.acquire(), timeout_s)
        except asyncio.TimeoutError:
            log.warning("usage consumer still writing after %.0f s at shutdown; cancelling it", timeout_s)
            self._task.cancel()
        else:
            self._task.cancel()  # it waits for its next round or for this lock: no write in progress
            self._drain_lock.release()
        await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        backoff = self.interval_s
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), backoff)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            try:
                await self.drain_once()
                backoff = self.interval_s
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.failures += 1
                backoff = min(MAX_BACKOFF_S, max(backoff * 2, 0.5))
                log.warning("usage ledger write failed (%s: %s); retrying in %.1fs; events stay spooled",
                            type(exc).__name__, exc, backoff)

    # ---- consuming ----------------------------------------------------------------------------------

    async def drain_once(self, include_orphans: bool = False) -> int:
        """Move every closed segment (and the in-memory backlog) into the ledger. Returns rows written. Calls
        that overlap (the consumer, shutdown, an explicit drain) run one after the other."""
        async with self._drain_lock:
            return await self._drain(include_orphans)

    async def _drain(self, include_orphans: bool) -> int:
        written = 0
        if self._memory_backlog:
            backlog, self._memory_backlog = self._memory_backlog, []
            try:
                written += await self._ingest(backlog)
            except BaseException:
                self._memory_backlog[:0] = backlog
                raise
        await self.spool.rotate()
        for segment in self.spool.closed_segments():
            written += await self._ingest(read_segment(segment))
            segment.unlink()  # the ack: only after the ledger committed
        loop = asyncio.get_running_loop()
        if include_orphans or loop.time() - self._last_orphan_scan > ORPHAN_SCAN_S:
            self._last_orphan_scan = loop.time()
            written += await self._adopt_orphans()
        async with self._drained:
            self._drained.notify_all()
        return written

    async def _adopt_orphans(self) -> int:
        written = 0
        for directory, fd in self.spool.orphans():
            try:
                for segment in list_segments(directory):
                    written += await self._ingest(read_segment(segment))
                    segment.unlink()
                log.info("usage spool of a stopped process replayed: %s", directory)
            finally:
                unlock(fd)
            if directory.name != "main":
                (directory / "lock").unlink(missing_ok=True)
                try:
                    directory.rmdir()
                except OSError:
                    pass
        return written

    async def _ingest(self, records: list[dict]) -> int:
        if not records:
            return 0
        new_ids = await insert_records(self.sessions, records)
        # a record may repeat within a batch: each new id once
        fresh = list({r["request_id"]: r for r in records if r["request_id"] in new_ids}.values())
        if self.on_ingested is not None and fresh:
            self.on_ingested(fresh)
        for r in records:
            self.pending.pop(r["request_id"], None)
        return len(fresh)

    # ---- views for quotas and exports -------------------------------------------------------------

    def pending_tokens(self, tenant_id: str, start: datetime, end: datetime) -> int:
        return sum(billable_tokens(r) for r, at in self.pending.values()
                   if r["tenant_id"] == tenant_id and start <= at < end)

    def has_pending_before(self, when: datetime) -> bool:
        return any(at < when for _, at in self.pending.values())

    async def wait_ingested_before(self, when: datetime, timeout_s: float) -> bool:
        """Wait until every event this process accepted with ``created_at < when`` is in the ledger."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.has_pending_before(when):
            left = deadline - loop.time()
            if left <= 0:
                return False
            self._wake.set()
            async with self._drained:
                try:
                    await asyncio.wait_for(self._drained.wait(), min(left, 1.0))
                except asyncio.TimeoutError:
                    pass
        return True
