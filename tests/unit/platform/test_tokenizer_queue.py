"""The tokenizer thread serves tenants in turn: a tenant with many long prompts queued delays another tenant's
call by at most one of its own, not all of them; errors reach the caller; a cancelled call never runs; shutdown
cancels what waits."""

from __future__ import annotations

import asyncio
import threading

import pytest

from loraplex.platform.inference.tokenizer_queue import TokenizerQueue


async def _held(queue: TokenizerQueue, tenant: str, ran: list[str]) -> tuple[asyncio.Task, threading.Event]:
    """A call of ``tenant`` that holds the thread until the returned event is set."""
    gate, entered = threading.Event(), threading.Event()

    def hold() -> None:
        entered.set()
        gate.wait(10)
        ran.append(f"{tenant}:held")

    task = asyncio.ensure_future(queue.run(tenant, hold))
    assert await asyncio.to_thread(entered.wait, 5)
    return task, gate


async def test_a_tenant_waits_for_one_call_of_a_busy_tenant_not_all_of_them():
    queue, ran = TokenizerQueue(), []
    held, gate = await _held(queue, "busy", ran)
    busy = [asyncio.ensure_future(queue.run("busy", ran.append, f"busy:{i}")) for i in range(9)]
    await asyncio.sleep(0)  # queued in this order: nine of "busy", then one of "quiet"
    quiet = asyncio.ensure_future(queue.run("quiet", ran.append, "quiet:0"))
    await asyncio.sleep(0)
    assert queue.waiting() == {"busy": 9, "quiet": 1}
    gate.set()
    await asyncio.gather(held, quiet, *busy)
    # first come, first served would run "quiet" last, after all nine
    assert ran[:3] == ["busy:held", "busy:0", "quiet:0"], ran
    assert ran[3:] == [f"busy:{i}" for i in range(1, 9)]  # each tenant's calls in their order
    queue.shutdown()


async def test_turns_alternate_between_tenants_with_work():
    queue, ran = TokenizerQueue(), []
    held, gate = await _held(queue, "a", ran)
    calls = [asyncio.ensure_future(queue.run(t, ran.append, f"{t}:{i}")) for t in "abc" for i in range(3)]
    await asyncio.sleep(0)
    gate.set()
    await asyncio.gather(held, *calls)
    assert ran[1:] == ["a:0", "b:0", "c:0", "a:1", "b:1", "c:1", "a:2", "b:2", "c:2"]
    queue.shutdown()


async def test_an_error_reaches_its_caller_and_the_thread_goes_on():
    queue = TokenizerQueue()

    def fails() -> None:
        raise ValueError("not a prompt")

    with pytest.raises(ValueError, match="not a prompt"):
        await queue.run("t", fails)
    assert await queue.run("t", len, [1, 2, 3]) == 3
    queue.shutdown()


async def test_a_call_cancelled_while_it_waits_never_runs():
    queue, ran = TokenizerQueue(), []
    held, gate = await _held(queue, "t", ran)
    doomed = asyncio.ensure_future(queue.run("t", ran.append, "doomed"))
    kept = asyncio.ensure_future(queue.run("u", ran.append, "kept"))
    await asyncio.sleep(0)
    doomed.cancel()
    gate.set()
    await asyncio.gather(held, kept)
    with pytest.raises(asyncio.CancelledError):
        await doomed
    assert ran == ["t:held", "kept"]
    queue.shutdown()


async def test_shutdown_cancels_waiting_calls_and_refuses_new_ones():
    queue, ran = TokenizerQueue(), []
    held, gate = await _held(queue, "t", ran)
    waiting = asyncio.ensure_future(queue.run("u", ran.append, "never"))
    await asyncio.sleep(0)
    queue.shutdown()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    with pytest.raises(RuntimeError, match="shutting down"):
        await queue.run("t", len, [])
    gate.set()
    await held  # the call that was running finishes
    assert ran == ["t:held"]
