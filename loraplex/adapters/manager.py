"""LoRAManager: adapters from disk -> host LRU cache -> GPU slots, and the per-step LoRA batch.

Bookkeeping lives on the host; the engine calls ``validate_and_prefetch`` when a request arrives (disk
read and validation happen then, off the step), ``acquire``/``release`` around a request's life (pinned
adapters are never evicted), and ``prepare_step`` once per step. Ids whose directory holds the same,
unchanged files share one validated host copy (``file_cache``): a file is read and validated once, not
once per id, and again only when it changes on disk.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

import torch

from loraplex.adapters.errors import AdapterError
from loraplex.adapters.file_cache import ValidatedFiles, file_key
from loraplex.adapters.host_cache import HostLRUCache
from loraplex.adapters.loader import HostAdapter, load_adapter
from loraplex.adapters.mapping import LoRAStep, token_slots_from_ids
from loraplex.adapters.modules import BaseShapes
from loraplex.adapters.slot_pool import SlotPool

log = logging.getLogger(__name__)


def _triton_usable(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


class LoRAManager:
    def __init__(self, hf_config: Any, max_loras: int, max_lora_rank: int, max_cpu_loras: int | None,
                 device: str | torch.device, dtype: torch.dtype) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {max_loras}")
        if max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {max_lora_rank}")
        self.shapes = BaseShapes.from_config(hf_config)
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.device = torch.device(device)
        self.dtype = dtype
        self.pool = SlotPool(self.shapes, max_loras, max_lora_rank, self.device, dtype)
        self.host_cache: HostLRUCache[HostAdapter] = HostLRUCache(max(max_cpu_loras or max_loras, max_loras))
        self._validated: ValidatedFiles[HostAdapter] = ValidatedFiles()
        self.use_triton = _triton_usable(self.device)
        self._paths: dict[int, str] = {}  # adapter_id -> lora_path, to re-read after a host eviction
        self._names: dict[int, str] = {}  # adapter_id -> lora_name (stats only)
        self._slot_of: dict[int, int] = {}
        self._slot_lru: OrderedDict[int, None] = OrderedDict()  # resident adapter ids, least recent first
        self._free_slots = list(range(max_loras - 1, -1, -1))  # popped from the end: lowest slot first
        self._pins: dict[int, int] = {}
        self._pending_removal: set[int] = set()
        # removed ids keep their path: a request queued before the removal can still re-read the files
        self._removed: set[int] = set()
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.num_loads = 0  # host -> GPU slot copies
        self.num_evictions = 0  # resident adapters displaced from a slot
        self.num_host_loads = 0  # disk -> host cache reads (validation included)
        self.num_host_reuses = 0  # host cache fills served by files already validated for another id

    # ---- adapters in host memory ---------------------------------------------------------------
    def validate_and_prefetch(self, lora_request) -> HostAdapter:
        """Validate and cache an adapter in host memory. Raises AdapterError for a bad adapter."""
        adapter_id, path = lora_request.lora_int_id, str(lora_request.lora_path)
        known = self._paths.get(adapter_id)
        if known is not None and known != path:
            if adapter_id not in self._removed:
                raise AdapterError(f"lora_int_id {adapter_id} is already registered for another path ({known})",
                                   file=path)
            if self._pins.get(adapter_id):
                raise AdapterError(f"lora_int_id {adapter_id} was replaced but its old version still serves running "
                                   "requests; retry when they finish", file=path)
            self._forget_weights(adapter_id)  # a new version under a removed id
        cached = self.host_cache.get(adapter_id)
        if cached is not None:
            return cached
        adapter = self._read(adapter_id, path)
        self._paths[adapter_id] = path
        self._names[adapter_id] = lora_request.lora_name
        self._pending_removal.discard(adapter_id)
        self._removed.discard(adapter_id)
        return adapter

    def _read(self, adapter_id: int, path: str) -> HostAdapter:
        key = file_key(path)  # taken before the read: a file changing during it is read again next time
        adapter = self._validated.get(key)
        if adapter is None:
            adapter = load_adapter(adapter_id, path, self.shapes, self.max_lora_rank, dtype=self.dtype,
                                   pin_memory=self.device.type == "cuda")
            self.num_host_loads += 1
            self._validated.put(key, adapter)
            log.info("adapter %d loaded to host: rank %d, modules %s", adapter_id, adapter.rank,
                     ",".join(adapter.spec.target_modules))
        else:
            self.num_host_reuses += 1
        self.host_cache.put(adapter_id, adapter)
        return adapter

    # ---- pins --------------------------------------------------------------------------------------
    def acquire(self, adapter_id: int) -> None:
        if adapter_id:
            self._pins[adapter_id] = self._pins.get(adapter_id, 0) + 1

    def release(self, adapter_id: int) -> None:
        if not adapter_id:
            return
        count = self._pins.get(adapter_id, 0) - 1
        assert count >= 0, f"release of adapter {adapter_id} without acquire"
        if count:
            self._pins[adapter_id] = count
            return
        self._pins.pop(adapter_id, None)
        if adapter_id in self._pending_removal:
            self._drop(adapter_id)

    def remove_adapter(self, adapter_id: int) -> None:
        """Forget an adapter (host cache and slot) once its last running request has released it."""
        if self._pins.get(adapter_id):
            self._pending_removal.add(adapter_id)
        else:
            self._drop(adapter_id)

    def _drop(self, adapter_id: int) -> None:
        self._pending_removal.discard(adapter_id)
        if adapter_id in self._paths:
            self._removed.add(adapter_id)
        self._forget_weights(adapter_id)

    def _forget_weights(self, adapter_id: int) -> None:
        self.host_cache.pop(adapter_id)
        slot = self._slot_of.pop(adapter_id, None)
        if slot is not None:
            self._slot_lru.pop(adapter_id, None)
            self.pool.clear(slot)
            self._free_slots.append(slot)

    # ---- GPU slots -----------------------------------------------------------------------------------
    def resident_adapter_ids(self) -> list[int]:
        return list(self._slot_lru)

    def pinned_adapter_ids(self) -> list[int]:
        """Adapters held by running requests (never evicted)."""
        return sorted(self._pins)

    def active_adapter_names(self) -> list[str]:
        """Names of the adapters holding a GPU slot."""
        return [self._names.get(a, str(a)) for a in self._slot_lru]

    def can_fit(self, adapter_ids) -> bool:
        """Whether these adapters can all hold a slot at once (pinned residents keep theirs)."""
        wanted = {a for a in adapter_ids if a}
        keep = wanted | {a for a in self._slot_of if self._pins.get(a)}
        return len(keep) <= self.max_loras

    def prepare_step(self, token_adapter_ids: torch.Tensor, adapter_ids=None) -> LoRAStep:
        """Give every adapter of the step a slot and build the step's mapping.

        ``adapter_ids`` (optional) lists the step's distinct adapter ids as known on the host; without it
        they are read from the tensor (one device->host sync).
        """
        if adapter_ids is None:
            adapter_ids = torch.unique(token_adapter_ids).tolist()
        slot_of = self.assign_slots(adapter_ids)
        token_slots = token_slots_from_ids(token_adapter_ids, slot_of)
        return LoRAStep(self.pool, token_slots, len(slot_of), self.use_triton)

    def assign_slots(self, adapter_ids) -> dict[int, int]:
        """Give every adapter of a step (ids, 0 = base, ignored) a GPU slot; returns adapter id -> slot.

        Host bookkeeping plus asynchronous slot fills. ``prepare_step`` uses it; the engine's CUDA-graph
        decode path calls it alone, writes the per-token slots into a static buffer and derives the kernel
        metadata inside the graph (``LoRAStep``)."""
        step_ids = sorted({int(a) for a in adapter_ids if a})
        if len(step_ids) > self.max_loras:
            raise RuntimeError(f"{len(step_ids)} adapters in one step, over max_loras={self.max_loras}")
        for adapter_id in step_ids:
            self._ensure_slot(adapter_id, step_ids)
        return {a: self._slot_of[a] for a in step_ids}

    def _ensure_slot(self, adapter_id: int, step_ids: list[int]) -> int:
        slot = self._slot_of.get(adapter_id)
        if slot is not None:
            self._slot_lru.move_to_end(adapter_id)
            return slot
        adapter = self.host_cache.get(adapter_id)
        if adapter is None:
            path = self._paths.get(adapter_id)
            if path is None:
                raise KeyError(f"adapter {adapter_id} was never prefetched (validate_and_prefetch first)")
            adapter = self._read(adapter_id, path)  # AdapterError if its files changed or disappeared
        slot = self._free_slot(step_ids)
        self._fill(slot, adapter)
        self._slot_of[adapter_id] = slot
        self._slot_lru[adapter_id] = None
        self.num_loads += 1
        return slot

    def _free_slot(self, step_ids: list[int]) -> int:
        if self._free_slots:
            return self._free_slots.pop()
        in_step = set(step_ids)
        for victim in self._slot_lru:  # least recently used first
            if victim not in in_step and not self._pins.get(victim):
                slot = self._slot_of.pop(victim)
                del self._slot_lru[victim]
                self.num_evictions += 1
                log.info("adapter %d evicted from slot %d", victim, slot)
                return slot
        raise RuntimeError("no GPU slot can be freed: every slot holds an adapter of this step or a running "
                           f"request (max_loras={self.max_loras}); the scheduler must keep within it")

    def _fill(self, slot: int, adapter: HostAdapter) -> None:
        if self._copy_stream is None:
            self.pool.fill(slot, adapter)
            return
        # the copy waits for kernels still reading the old occupant, and the next step waits for the copy
        current = torch.cuda.current_stream(self.device)
        self._copy_stream.wait_stream(current)
        with torch.cuda.stream(self._copy_stream):
            self.pool.fill(slot, adapter)
        current.wait_stream(self._copy_stream)
