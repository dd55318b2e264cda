"""The HTTP side's one tokenizer thread, shared by every tenant and served to them in turn.

Tokenizing runs off the event loop (a long prompt would stall every stream) and on one thread (a fast tokenizer is
not safe to call from several at once). Before the rate limits can count a request's tokens its prompt must be
tokenized, so the thread is the one resource every request uses ahead of its tenant's limits. Served first come,
first served, a tenant that sends many long prompts at once would make every other tenant's requests wait behind
all of them (and could time them). Here each tenant has its own queue and the thread takes one call from each
tenant with work in turn: another tenant's call waits for at most one call of each busy tenant (each bounded by
``pipeline.check_prompt_chars``), however many that tenant has queued.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import threading
from collections.abc import Callable
from typing import Any


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():  # the caller went away (cancelled) meanwhile
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class TokenizerQueue:
    """``await queue.run(tenant, fn, *args)``: ``fn(*args)`` on the tokenizer thread, tenants served round-robin,
    each tenant's calls in the order they came. A call whose caller was cancelled before its turn never runs."""

    def __init__(self, name: str = "loraplex-tokenizer") -> None:
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._queues: dict[str, collections.deque] = {}  # tenant -> its waiting calls
        self._turns: collections.deque[str] = collections.deque()  # tenants with waiting calls, next first
        self._closed = False
        self._name = name
        self._thread: threading.Thread | None = None  # started by the first call

    async def run(self, tenant: str, fn: Callable, *args, **kwargs) -> Any:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the tokenizer thread has stopped (the server is shutting down)")
            calls = self._queues.get(tenant)
            if calls is None:
                calls = self._queues[tenant] = collections.deque()
                self._turns.append(tenant)
            calls.append((functools.partial(fn, *args, **kwargs), future, loop))
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name=self._name, daemon=True)
                self._thread.start()
            self._ready.notify()
        return await future

    def waiting(self) -> dict[str, int]:
        """Calls waiting, per tenant (not the one running)."""
        with self._lock:
            return {tenant: len(calls) for tenant, calls in self._queues.items()}

    def _next(self):
        with self._lock:
            while not self._turns:
                if self._closed:
                    return None
                self._ready.wait()
            tenant = self._turns.popleft()
            calls = self._queues[tenant]
            call = calls.popleft()
            if calls:
                self._turns.append(tenant)  # its next call after every other waiting tenant's
            else:
                del self._queues[tenant]
            return call

    def _serve(self) -> None:
        while (item := self._next()) is not None:
            call, future, loop = item
            if future.done():  # cancelled while it waited: skip the work
                continue
            try:
                result, error = call(), None
            except BaseException as exc:  # noqa: BLE001 (handed to the caller)
                result, error = None, exc
            try:
                loop.call_soon_threadsafe(_settle, future, result, error)
            except RuntimeError:  # the caller's event loop has closed
                pass

    def shutdown(self) -> None:
        """Stop taking calls; those still waiting are cancelled (their callers get CancelledError)."""
        with self._lock:
            self._closed = True
            waiting = [item for calls in self._queues.values() for item in calls]
            self._queues.clear()
            self._turns.clear()
            self._ready.notify_all()
        for _, future, loop in waiting:
            try:
                loop.call_soon_threadsafe(future.cancel)
            except RuntimeError:
                pass
