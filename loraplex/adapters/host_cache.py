"""Host-memory LRU of loaded adapters, keyed by adapter id. Pure bookkeeping.

Capacity (``max_cpu_loras``) counts distinct host copies, not ids: ids that name the same unchanged files
share one copy (``file_cache``), so 1,000 ids over 16 files take 16 entries' worth of memory and evict
nothing. Eviction removes the least recently used copy with all its ids, skipping copies that an id in
``keep`` (adapters the next waiting requests need) still uses while another copy can go.

Dropping an entry only costs a re-read from disk later: a GPU slot keeps its own copy, so an adapter in
use is never lost by a host eviction.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container
from typing import Generic, TypeVar

V = TypeVar("V")


class HostLRUCache(Generic[V]):
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"max_cpu_loras must be >= 1, got {capacity}")
        self.capacity = capacity
        self._items: OrderedDict[int, V] = OrderedDict()  # adapter id -> its copy, least recent first
        self._aliases: dict[int, set[int]] = {}  # id(copy) -> adapter ids holding it
        self.num_evictions = 0  # adapter ids evicted

    def __contains__(self, adapter_id: int) -> bool:
        return adapter_id in self._items

    def __len__(self) -> int:
        return len(self._items)

    @property
    def num_copies(self) -> int:
        return len(self._aliases)

    def get(self, adapter_id: int) -> V | None:
        item = self._items.get(adapter_id)
        if item is not None:
            self._items.move_to_end(adapter_id)
        return item

    def put(self, adapter_id: int, item: V, keep: Container[int] = ()) -> list[int]:
        """Insert as most recent; returns the ids evicted to stay within capacity."""
        self.pop(adapter_id)
        self._items[adapter_id] = item
        self._aliases.setdefault(id(item), set()).add(adapter_id)
        evicted: list[int] = []
        while len(self._aliases) > self.capacity:
            evicted += self._evict_one(id(item), keep)
        self.num_evictions += len(evicted)
        return evicted

    def _evict_one(self, protected: int, keep: Container[int]) -> list[int]:
        """Drop the least recently used copy other than ``protected``, preferring one no id in ``keep`` uses."""
        fallback = None
        for item in self._items.values():
            copy = id(item)
            if copy == protected:
                continue
            if not any(a in keep for a in self._aliases[copy]):
                fallback = copy
                break
            fallback = fallback if fallback is not None else copy
        assert fallback is not None, "over capacity with a single copy"
        ids = sorted(self._aliases.pop(fallback))
        for adapter_id in ids:
            del self._items[adapter_id]
        return ids

    def pop(self, adapter_id: int) -> V | None:
        item = self._items.pop(adapter_id, None)
        if item is not None:
            aliases = self._aliases[id(item)]
            aliases.discard(adapter_id)
            if not aliases:
                del self._aliases[id(item)]
        return item

    def ids(self) -> list[int]:
        return list(self._items)
