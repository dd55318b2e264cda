"""Host-memory LRU of loaded adapters (``max_cpu_loras`` entries). Pure bookkeeping.

Dropping an entry only costs a re-read from disk later: a GPU slot keeps its own copy, so an adapter in
use is never lost by a host eviction.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

V = TypeVar("V")


class HostLRUCache(Generic[V]):
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"max_cpu_loras must be >= 1, got {capacity}")
        self.capacity = capacity
        self._items: OrderedDict[int, V] = OrderedDict()
        self.num_evictions = 0

    def __contains__(self, adapter_id: int) -> bool:
        return adapter_id in self._items

    def __len__(self) -> int:
        return len(self._items)

    def get(self, adapter_id: int) -> V | None:
        item = self._items.get(adapter_id)
        if item is not None:
            self._items.move_to_end(adapter_id)
        return item

    def put(self, adapter_id: int, item: V) -> list[int]:
        """Insert as most recent; returns the ids evicted to stay within capacity."""
        self._items[adapter_id] = item
        self._items.move_to_end(adapter_id)
        evicted = []
        while len(self._items) > self.capacity:
            old, _ = self._items.popitem(last=False)
            evicted.append(old)
        self.num_evictions += len(evicted)
        return evicted

    def pop(self, adapter_id: int) -> V | None:
        return self._items.pop(adapter_id, None)

    def ids(self) -> list[int]:
        return list(self._items)
