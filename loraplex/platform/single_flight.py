"""Concurrent cache misses of one key share one lookup (a burst of requests after a cache entry expires would
otherwise each open a database session for the same row, and exhaust the pool)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

T = TypeVar("T")


class SingleFlight(Generic[T]):
    def __init__(self) -> None:
        self._flights: dict[Hashable, asyncio.Future[T]] = {}

    async def run(self, key: Hashable, lookup: Callable[[], Awaitable[T]]) -> T:
        """``lookup()``'s result, shared by every caller that asks for ``key`` while one is running; its exception
        reaches each of them. A caller that is cancelled (its client went away) does not cancel the others'."""
        flight = self._flights.get(key)
        if flight is None:
            flight = asyncio.ensure_future(lookup())
            self._flights[key] = flight
            flight.add_done_callback(lambda done, k=key: self._done(k, done))
        return await asyncio.shield(flight)

    def _done(self, key: Hashable, flight: asyncio.Future[T]) -> None:
        if self._flights.get(key) is flight:
            del self._flights[key]
        if not flight.cancelled():
            flight.exception()  # retrieved: every waiter may have gone, and asyncio would log it as lost

    def __len__(self) -> int:
        return len(self._flights)
