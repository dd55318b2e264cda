"""The spool: durable appends with group commit, torn tails, rotation, and adoption of a dead
process's segments."""

from __future__ import annotations

import asyncio
import os

from loraplex.platform.usage.spool import MAIN_OWNER, Spool, list_segments, read_segment, unlock


async def test_concurrent_appends_land_in_order_and_survive_reopen(tmp_path):
    spool = Spool(tmp_path)
    spool.open()
    assert spool.directory.name == MAIN_OWNER
    await asyncio.gather(*(spool.append({"request_id": f"r{i}", "n": i}) for i in range(200)))
    await spool.rotate()
    await spool.append({"request_id": "late"})
    spool.close()
    # a new process finds both segments in the same directory
    again = Spool(tmp_path)
    again.open()
    segments = again.closed_segments()
    assert len(segments) == 2
    records = [r for s in segments for r in read_segment(s)]
    assert [r["request_id"] for r in records] == [f"r{i}" for i in range(200)] + ["late"]
    again.close()


async def test_torn_last_line_is_dropped_and_the_rest_kept(tmp_path, caplog):
    spool = Spool(tmp_path)
    spool.open()
    await spool.append({"request_id": "a"})
    await spool.append({"request_id": "b"})
    await spool.rotate()
    (segment,) = spool.closed_segments()
    with open(segment, "ab") as f:
        f.write(b'{"request_id": "tor')  # the process died inside write(): never fsynced, never acknowledged
    assert [r["request_id"] for r in read_segment(segment)] == ["a", "b"]
    assert "torn" in caplog.text
    spool.close()


async def test_second_live_process_gets_its_own_directory_and_dead_ones_are_adopted(tmp_path):
    first = Spool(tmp_path)
    first.open()
    second = Spool(tmp_path)
    second.open()
    assert second.directory != first.directory  # main is locked by the first
    assert second.orphans() == []  # the first is alive: not an orphan
    await second.append({"request_id": "x"})
    await second.rotate()
    second_dir = second.directory
    # the second process "dies": its lock is released, its segment stays
    unlock(second._lock_fd)
    second._lock_fd = None
    orphans = first.orphans()
    assert [d for d, _ in orphans] == [second_dir]
    (directory, fd), = orphans
    assert [r["request_id"] for s in list_segments(directory) for r in read_segment(s)] == ["x"]
    unlock(fd)
    first.close()


async def test_failed_write_reaches_every_waiter(tmp_path):
    spool = Spool(tmp_path)
    spool.open()
    await spool.append({"request_id": "ok"})
    read_only = os.open(os.devnull, os.O_RDONLY)  # the disk "fails": writes to the segment raise EBADF
    os.dup2(read_only, spool._fd)
    os.close(read_only)
    results = await asyncio.gather(*(spool.append({"request_id": i}) for i in range(3)), return_exceptions=True)
    assert all(isinstance(r, OSError) for r in results)
    await spool.append({"request_id": "after"})  # the next batch starts a new segment
    await spool.rotate()
    ids = [r["request_id"] for s in spool.closed_segments() for r in read_segment(s)]
    assert ids == ["ok", "after"]
    spool.close()
