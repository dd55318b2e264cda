"""A local, append-only, fsynced spool of usage events: what makes metering survive SIGKILL.

Each event is one JSON line. :meth:`Spool.append` returns only after the line is on disk (``fsync``);
concurrent appends share one ``fsync`` (group commit), so a burst of finishing requests costs one disk
flush, not one each. The consumer takes whole *closed* segments (:meth:`Spool.rotate`), writes them to
the ledger idempotently, and only then deletes them: a crash anywhere replays a segment, and the
ledger's unique ``request_id`` turns the replay into a no-op.

Layout: ``<root>/<owner>/seg-<n>.jsonl`` plus ``<owner>/lock``, an ``flock`` held for the process's
lifetime. A process uses ``<root>/main`` when it can lock it (so a restarted server finds its own
segments), else a directory of its own; a directory whose lock is free belongs to a dead process and
is adopted (:meth:`Spool.orphans`).
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import os
import uuid
from pathlib import Path

log = logging.getLogger(__name__)

SEGMENT_PREFIX = "seg-"
SEGMENT_SUFFIX = ".jsonl"
MAIN_OWNER = "main"


def _segment_number(path: Path) -> int:
    return int(path.name[len(SEGMENT_PREFIX):-len(SEGMENT_SUFFIX)])


def list_segments(directory: Path) -> list[Path]:
    paths = [p for p in directory.glob(f"{SEGMENT_PREFIX}*{SEGMENT_SUFFIX}")]
    return sorted(paths, key=_segment_number)


def read_segment(path: Path) -> list[dict]:
    """The records of a segment. A torn last line (the process died inside ``write``) is dropped: its
    ``fsync`` never returned, so the request it belongs to was never acknowledged to its client."""
    records = []
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    for i, line in enumerate(lines):
        if not line:
            continue
        try:
            records.append(json.loads(line))
        except ValueError:
            if i == len(lines) - 1:
                log.warning("spool %s: dropped a torn last line (%d bytes)", path, len(line))
            else:
                log.error("spool %s: line %d is corrupt; skipped", path, i + 1)
    return records


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def try_lock(directory: Path) -> int | None:
    """An exclusive ``flock`` on ``directory/lock`` (fd), or None if a live process holds it."""
    fd = os.open(directory / "lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def unlock(fd: int) -> None:
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


class Spool:
    def __init__(self, root: Path, *, fsync: bool = True):
        self.root = Path(root)
        self.fsync = fsync
        self.directory: Path | None = None
        self._lock_fd: int | None = None
        self._fd: int | None = None  # the open segment
        self._segment: Path | None = None
        self._next_number = 0
        self._buffer: list[bytes] = []
        self._batch: asyncio.Future | None = None
        self._flusher: asyncio.Task | None = None
        self._io = asyncio.Lock()  # one writer or rotation at a time

    # ---- lifecycle -------------------------------------------------------------------------------

    def open(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        for owner in (MAIN_OWNER, f"p{os.getpid()}-{uuid.uuid4().hex[:8]}"):
            directory = self.root / owner
            directory.mkdir(exist_ok=True)
            fd = try_lock(directory)
            if fd is not None:
                self.directory, self._lock_fd = directory, fd
                break
        assert self.directory is not None, "a fresh spool directory is always lockable"
        existing = list_segments(self.directory)
        self._next_number = _segment_number(existing[-1]) + 1 if existing else 0
        log.info("usage spool at %s (%d segment(s) to replay)", self.directory, len(existing))

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._lock_fd is not None:
            unlock(self._lock_fd)
            self._lock_fd = None
        # an empty directory other than main is not worth keeping
        if self.directory is not None and self.directory.name != MAIN_OWNER and not list_segments(self.directory):
            for leftover in ("lock",):
                (self.directory / leftover).unlink(missing_ok=True)
            try:
                self.directory.rmdir()
            except OSError:
                pass

    # ---- writing ---------------------------------------------------------------------------------

    async def append(self, record: dict) -> None:
        """Durably append one record (returns after its ``fsync``). Raises OSError on disk failure."""
        assert self.directory is not None, "Spool.open() first"
        self._buffer.append(json.dumps(record, separators=(",", ":")).encode() + b"\n")
        if self._batch is None:
            self._batch = asyncio.get_running_loop().create_future()
        batch = self._batch
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush_loop(), name="usage-spool-flush")
        await asyncio.shield(batch)

    async def _flush_loop(self) -> None:
        while self._buffer:
            payload, batch = b"".join(self._buffer), self._batch
            self._buffer, self._batch = [], None
            try:
                async with self._io:
                    await asyncio.to_thread(self._write, payload)
            except BaseException as exc:  # the waiters learn the write failed
                self._abandon_segment()
                if batch is not None and not batch.done():
                    batch.set_exception(exc if isinstance(exc, Exception) else OSError(str(exc)))
                if not isinstance(exc, Exception):
                    raise
                continue
            if batch is not None and not batch.done():
                batch.set_result(None)

    def _abandon_segment(self) -> None:
        """After a failed write: the next batch starts a new segment (this one may end in a torn line,
        and lines of the failed batch that did land are harmless duplicates for the ledger)."""
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd, self._segment = None, None

    def _write(self, payload: bytes) -> None:
        if self._fd is None:
            self._segment = self.directory / f"{SEGMENT_PREFIX}{self._next_number:012d}{SEGMENT_SUFFIX}"
            self._next_number += 1
            self._fd = os.open(self._segment, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            if self.fsync:
                _fsync_dir(self.directory)  # the new file's name must survive a crash too
        view = memoryview(payload)
        while view:
            n = os.write(self._fd, view)
            view = view[n:]
        if self.fsync:
            os.fsync(self._fd)

    # ---- consuming -------------------------------------------------------------------------------

    async def rotate(self) -> None:
        """Close the open segment (if any) so the consumer may take it."""
        async with self._io:
            if self._fd is not None:
                os.close(self._fd)
                self._fd, self._segment = None, None

    def closed_segments(self) -> list[Path]:
        assert self.directory is not None
        return [p for p in list_segments(self.directory) if p != self._segment]

    def orphans(self) -> list[tuple[Path, int]]:
        """Spool directories of dead processes (their lock was free), other than ours, each with its
        lock now held by us: release it with :func:`unlock` when done."""
        out = []
        for directory in sorted(p for p in self.root.iterdir() if p.is_dir() and p != self.directory):
            fd = try_lock(directory)
            if fd is not None:
                out.append((directory, fd))
        return out
