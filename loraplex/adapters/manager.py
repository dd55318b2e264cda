"""LoRAManager: adapters from disk -> host LRU cache -> GPU slots, and the per-step LoRA batch.

Bookkeeping lives on the engine thread; disk reads do not. The engine calls ``submit`` when a request
arrives (a background read starts; nothing waits), the scheduler calls ``poll`` at the start of each step
(finished reads enter the host cache, failed ones are returned so their requests fail, and the adapters of
the first waiting requests are read ahead) and admits a request only once ``is_ready`` says its adapter is
in host memory or a slot. ``acquire``/``release`` pin the adapters of running requests (never evicted),
``prefetch_slots`` copies the adapters of the next waiting requests into slots while the current step
runs, and ``prepare_step``/``assign_slots`` give every adapter of a step a slot, waiting only for the fills
of those slots. Ids whose directory holds the same, unchanged files share one validated host copy
(``file_cache``), and concurrent reads of one file are one read. ``validate_and_prefetch`` is the
synchronous read (same checks, same errors).
"""

from __future__ import annotations

import functools
import heapq
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from loraplex.adapters.errors import AdapterError
from loraplex.adapters.file_cache import ValidatedFiles, file_key
from loraplex.adapters.host_cache import HostLRUCache
from loraplex.adapters.loader import HostAdapter
from loraplex.adapters.mapping import (
    LoRAStep,
    StepKernelOptions,
    folds_shrink,
    fuses_silu_mul,
    token_slots_from_ids,
    warmup_steps,
)
from loraplex.adapters.modules import BaseShapes
from loraplex.adapters.packed import load_packed_adapter
from loraplex.adapters.prefetch import BackgroundLoader
from loraplex.adapters.slot_pool import SlotPool

log = logging.getLogger(__name__)

# the in-GEMM shrink's bound on rows x GEMM width in slots: at 256 rows on 256 slots (run 18, H200) the extra rows made
# the GEMM compute-bound and it lost; 128 x 128 (every slot in use), 64 x 64 and 248 x 32 (run 29, H100; run 30, H200)
# won
GEMM_SHRINK_MAX_WORK = 128 * 128
# above this many rows the base GEMM itself is near compute-bound and every extra row costs its multiplies: at 248 rows
# on an H200 (run 30) 32 slots won (-0.11 ms a decode step) and 64 lost (zipf, 46 adapters: +0.36 ms)
GEMM_SHRINK_WIDE_ROWS = 128
GEMM_SHRINK_MAX_WIDTH_WIDE = 32


@functools.cache  # asked twice per decode step (assign_slots, then gemm_shrink_width) for a handful of buckets
def gemm_shrink_widths(max_loras: int, num_tokens: int) -> tuple[int, ...]:
    """The GEMM widths (in slots, ascending) of the in-GEMM shrink for a pure-decode step of ``num_tokens`` rows over
    ``max_loras`` slots: 4, 8, 16, ... and ``max_loras``, each at most twice the rows (the step's adapters must fill
    half of it), with rows x width <= ``GEMM_SHRINK_MAX_WORK`` and, above ``GEMM_SHRINK_WIDE_ROWS`` rows, at most
    ``GEMM_SHRINK_MAX_WIDTH_WIDE`` slots."""
    ladder = sorted({w for w in (4 << i for i in range(max_loras.bit_length())) if w < max_loras} | {max_loras})
    most = GEMM_SHRINK_MAX_WIDTH_WIDE if num_tokens > GEMM_SHRINK_WIDE_ROWS else max_loras
    return tuple(w for w in ladder if w <= 2 * num_tokens and num_tokens * w <= GEMM_SHRINK_MAX_WORK and w <= most)


def _triton_usable(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def _canonical(path) -> str:
    """One spelling per adapter directory ("d", "d/", "x/../d", a link to it): the id clash check compares these."""
    return os.path.realpath(os.fspath(path))


@dataclass(eq=False)
class _PendingLoad:
    key: Hashable  # file identity being read
    path: str
    name: str


class LoRAManager:
    def __init__(self, hf_config: Any, max_loras: int, max_lora_rank: int, max_cpu_loras: int | None,
                 device: str | torch.device, dtype: torch.dtype, num_load_workers: int | None = None,
                 tp=None) -> None:
        """``hf_config``: the model this process runs (under tensor parallelism its rank's shard, with ``tp`` =
        (``parallel.TPInfo``, the whole model's config): adapters are validated against the whole model and
        cut to the shard)."""
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {max_loras}")
        if max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {max_lora_rank}")
        self.shapes = BaseShapes.from_config(hf_config)
        self.tp = None if tp is None else (tp[0], BaseShapes.from_config(tp[1]))
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.device = torch.device(device)
        self.dtype = dtype
        self.pool = SlotPool(self.shapes, max_loras, max_lora_rank, self.device, dtype)
        self.merged = None  # MergedLoRA (engine option merge_single_lora): single-adapter stretches on merged weights
        self.fuse_silu_mul = False  # gate|up's delta inside SiLU-and-multiply (engine option fuse_lora_silu_mul)
        self.silu_mul_min_tokens = 0  # ... in steps of at least this many tokens (lora_silu_mul_min_tokens; 0: never)
        self.overlap_shrink = False  # shrink on a forked stream alongside the base GEMM (engine option lora_overlap_shrink)
        # steps of at least this many tokens run the LoRA work before the base GEMM (engine option
        # lora_expand_first_min_tokens; 0: never)
        self.expand_first_min_tokens = 0
        # eager steps' kernel tiles follow where most of their tokens are (engine option lora_segment_tiles)
        self.segment_tiles = False
        # pure-decode steps of at most this many tokens (0: never) whose distinct adapters fill at least half of the
        # slots run each folded projection's shrink inside its base GEMM (engine option lora_gemm_shrink; the model
        # runner folds the weights, SlotPool.fold_base_weights, and sets this)
        self.gemm_shrink_max_tokens = 0
        # moves per decode step (0: none) that bring the step's adapters into the first W slots for the in-GEMM shrink
        # (``assign_slots`` with ``decode_tokens``; engine option lora_gemm_shrink_max_moves)
        self.gemm_shrink_max_moves = 0
        # steps of at most this many tokens (0: never) run down's shrink inside SiLU-and-multiply (engine option
        # lora_fold_shrink_max_tokens)
        self.fold_shrink_max_tokens = 0
        self.host_cache: HostLRUCache[HostAdapter] = HostLRUCache(max(max_cpu_loras or max_loras, max_loras))
        self._validated: ValidatedFiles[HostAdapter] = ValidatedFiles()
        self.loader = BackgroundLoader(self._load_files, num_load_workers or min(4, os.cpu_count() or 1))
        self.use_triton = _triton_usable(self.device)
        self._paths: dict[int, str] = {}  # adapter_id -> lora_path, to re-read after a host eviction
        self._names: dict[int, str] = {}  # adapter_id -> lora_name (stats only)
        self._loading: dict[int, _PendingLoad] = {}  # adapter_id -> the background read it waits for
        # adapter_id -> path, for ids submitted while every loader worker was busy (no read started yet): the
        # id is taken by that path as much as by a read in flight
        self._queued: dict[int, str] = {}
        self._reads: dict[Hashable, list[int]] = {}  # file identity being read -> ids waiting for it
        # distinct adapters of the first waiting requests, in scheduling order (from ``poll``): read ahead,
        # kept in the host cache, filled into slots ahead of need and not evicted for another prefetch
        self._lookahead: list[int] = []
        self._lookahead_set: set[int] = set()
        self._slot_of: dict[int, int] = {}
        self._slot_lru: OrderedDict[int, None] = OrderedDict()  # resident adapter ids, least recent first
        # a heap: the lowest free slot first, so the adapters in use sit in the low slots (the in-GEMM shrink
        # computes y for the first slots only, ``gemm_shrink_width``)
        self._free_slots = list(range(max_loras))
        self._pins: dict[int, int] = {}
        # adapters pinned from code (vLLM's pin_lora): one pin each, kept in a slot until removed
        self._kept: set[int] = set()
        self._pending_removal: set[int] = set()
        # ids whose weights were forgotten (removed, or replaced by a new version): KV computed with the old
        # weights must not be served from the prefix cache (``take_dropped``)
        self._dropped: list[int] = []
        # removed ids keep their path: a request queued before the removal can still re-read the files
        self._removed: set[int] = set()
        self.num_loads = 0  # host -> GPU slot copies
        self.num_prefetched_loads = 0  # of which made ahead of the step that needed them
        self.num_prefetch_deferrals = 0  # prefetch passes cut short because the fills' staging buffers were full
        self.num_evictions = 0  # resident adapters displaced from a slot
        self.num_slot_moves = 0  # adapters moved between slots (for the in-GEMM shrink, ``assign_slots``)
        self.num_gemm_shrink_steps = 0  # steps given an in-GEMM shrink width (``gemm_shrink_width``)
        self.num_host_loads = 0  # disk -> host cache reads (validation included)
        self.num_host_reuses = 0  # host cache fills served by files already validated for another id
        self.num_load_failures = 0  # reads that failed (each fails the requests waiting for it)
        self.host_load_seconds = 0.0  # wall time of all reads (background and synchronous)

    # ---- adapters in host memory ---------------------------------------------------------------
    def submit(self, lora_request) -> None:
        """Register a request's adapter; returns at once (the engine's ``add_request``). The read starts
        now when a loader worker is idle, else at a later ``poll`` in scheduling order (a burst of requests
        never reads more adapters ahead than the host cache holds). Raises AdapterError only for an id
        clash; a bad file is reported by ``poll``."""
        adapter_id, path = lora_request.lora_int_id, _canonical(lora_request.lora_path)
        self._check_path(adapter_id, path)
        if self.is_ready(adapter_id) or adapter_id in self._loading:
            return
        if len(self._loading) < self.loader.num_workers:
            self._start_load(adapter_id, path, lora_request.lora_name)
        else:
            self._queued[adapter_id] = path

    def validate_and_prefetch(self, lora_request) -> HostAdapter:
        """Validate and cache an adapter in host memory now. Raises AdapterError for a bad adapter."""
        adapter_id, path = lora_request.lora_int_id, _canonical(lora_request.lora_path)
        self._check_path(adapter_id, path)
        cached = self.host_cache.get(adapter_id)
        if cached is not None:
            return cached
        adapter = self._read(adapter_id, path)
        self._loaded(adapter_id, path, lora_request.lora_name)
        return adapter

    def poll(self, waiting: Iterable[Any] = ()) -> dict[int, str]:
        """Once per step, before admission: take finished background reads into the host cache, then start
        reads for the adapters of the first waiting requests (``waiting``: their LoRA requests in scheduling
        order, as many distinct ids as the host cache holds). Returns adapter id -> error text for reads
        that failed: the requests waiting for those adapters fail."""
        ahead: dict[int, Any] = {}  # adapter id -> a LoRA request naming it, first come first
        for lora_request in waiting:
            ahead.setdefault(lora_request.lora_int_id, lora_request)
            if len(ahead) >= self.host_cache.capacity:
                break
        self._lookahead, self._lookahead_set = list(ahead), set(ahead)
        failures = self._collect()
        for adapter_id, lora_request in ahead.items():
            if adapter_id not in failures and not self.is_ready(adapter_id) and adapter_id not in self._loading:
                # the registered version (a replacement under a removed id) before the request's own path
                path = (self._queued.get(adapter_id) or self._paths.get(adapter_id)
                        or _canonical(lora_request.lora_path))
                self._start_load(adapter_id, path, lora_request.lora_name)
        return failures

    def is_ready(self, adapter_id: int) -> bool:
        """The adapter can run in the next step without a disk read (in host memory or in a slot)."""
        return adapter_id in self._slot_of or adapter_id in self.host_cache

    def is_resident(self, adapter_id: int) -> bool:
        return adapter_id in self._slot_of

    def wait_for_load(self, timeout: float) -> bool:
        """Block until a background read finishes (at most ``timeout`` s): for an engine with nothing to run
        but requests waiting for their adapters. False at once when no read is in flight."""
        return self.loader.wait(timeout)

    @property
    def num_pending_loads(self) -> int:
        """Load queue depth: file reads queued or running in the background."""
        return self.loader.num_in_flight

    @property
    def num_loading_adapters(self) -> int:
        """Adapter ids waiting for a background read."""
        return len(self._loading)

    def _check_path(self, adapter_id: int, path: str) -> None:
        pending = self._loading.get(adapter_id)
        known = pending.path if pending is not None else self._queued.get(adapter_id) or self._paths.get(adapter_id)
        if known is None or known == path:
            return
        if adapter_id not in self._removed:
            raise AdapterError(f"lora_int_id {adapter_id} is already registered for another path ({known})",
                               file=path)
        if self._pins.get(adapter_id):
            raise AdapterError(f"lora_int_id {adapter_id} was replaced but its old version still serves running "
                               "requests; retry when they finish", file=path)
        self._forget_weights(adapter_id)  # a new version under a removed id

    def _start_load(self, adapter_id: int, path: str, name: str) -> None:
        self._queued.pop(adapter_id, None)
        key = file_key(path)  # taken before the read: a file changing during it is read again next time
        shared = self._validated.get(key)
        if shared is not None:  # files already validated for another id: no read at all
            self.num_host_reuses += 1
            self.host_cache.put(adapter_id, shared, keep=self._host_keep)
            self._loaded(adapter_id, path, name)
            return
        read_key = key if key is not None else ("unreadable", path)
        self._loading[adapter_id] = _PendingLoad(read_key, path, name)
        ids = self._reads.get(read_key)
        if ids is None:
            self._reads[read_key] = [adapter_id]
            self.loader.submit(read_key, path)
        else:
            ids.append(adapter_id)  # the same files are being read for another id: wait for that read

    def _collect(self) -> dict[int, str]:
        failures: dict[int, str] = {}
        for result in self.loader.take_done():
            ids = self._reads.pop(result.key, [])
            self.host_load_seconds += result.seconds
            if result.error is None:
                self.num_host_loads += 1
                if result.key[0] != "unreadable":
                    self._validated.put(result.key, result.adapter)
                log.info("adapter %s read in %.3f s: rank %d, modules %s", result.path, result.seconds,
                         result.adapter.rank, ",".join(result.adapter.spec.target_modules))
            else:
                self.num_load_failures += 1
                # a refused adapter (AdapterError, OSError) is the user's; anything else is ours: keep its traceback
                unexpected = not isinstance(result.error, (AdapterError, OSError))
                log.warning("adapter %s failed to load: %s", result.path, result.error,
                            exc_info=result.error if unexpected else None)
            served = 0
            for adapter_id in ids:
                pending = self._loading.get(adapter_id)
                if pending is None or pending.key != result.key:
                    continue  # removed or replaced while the read ran
                if result.error is not None:
                    del self._loading[adapter_id]
                    failures[adapter_id] = str(result.error)
                    continue
                self.num_host_reuses += served > 0
                served += 1
                self.host_cache.put(adapter_id, result.adapter, keep=self._host_keep)
                self._loaded(adapter_id, pending.path, pending.name)
        return failures

    def _loaded(self, adapter_id: int, path: str, name: str) -> None:
        self._loading.pop(adapter_id, None)
        self._queued.pop(adapter_id, None)
        self._paths[adapter_id] = path
        self._names[adapter_id] = name
        self._pending_removal.discard(adapter_id)
        self._removed.discard(adapter_id)

    def _read(self, adapter_id: int, path: str) -> HostAdapter:
        """Synchronous read into the host cache (shared validated files are not read again)."""
        key = file_key(path)
        adapter = self._validated.get(key)
        if adapter is None:
            started = time.perf_counter()
            adapter = self._load_files(path, adapter_id)
            self.host_load_seconds += time.perf_counter() - started
            self.num_host_loads += 1
            self._validated.put(key, adapter)
            log.info("adapter %d read on the engine thread: rank %d", adapter_id, adapter.rank)
        else:
            self.num_host_reuses += 1
        self.host_cache.put(adapter_id, adapter, keep=self._host_keep)
        return adapter

    def _load_files(self, path: str, adapter_id: int = 0) -> HostAdapter:
        """Read, validate and pack one adapter directory (any thread; touches no shared state)."""
        return load_packed_adapter(adapter_id, path, self.shapes, self.max_lora_rank, dtype=self.dtype,
                                   pin_memory=self.device.type == "cuda", tp=self.tp)

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
        """Forget an adapter (host cache, slot, a read in flight) once its last running request has
        released it; a pin from ``keep_resident`` ends now."""
        if adapter_id in self._kept:
            self._kept.discard(adapter_id)
            self.release(adapter_id)
        if self._pins.get(adapter_id):
            self._pending_removal.add(adapter_id)
        else:
            self._drop(adapter_id)

    def _drop(self, adapter_id: int) -> None:
        self._pending_removal.discard(adapter_id)
        if adapter_id in self._paths:
            self._removed.add(adapter_id)
        self._forget_weights(adapter_id)

    def take_dropped(self) -> list[int]:
        """Adapter ids whose weights were forgotten since the last call (the scheduler drops their cached KV)."""
        dropped, self._dropped = self._dropped, []
        return dropped

    def _forget_weights(self, adapter_id: int) -> None:
        self._dropped.append(adapter_id)
        self._loading.pop(adapter_id, None)  # a read still in flight is ignored for this id
        self._queued.pop(adapter_id, None)
        self.host_cache.pop(adapter_id)
        slot = self._slot_of.pop(adapter_id, None)
        if slot is not None:
            self._slot_lru.pop(adapter_id, None)
            self._free_slot(slot)

    def _free_slot(self, slot: int) -> None:
        """Clear a slot's ranks and give it back (lowest free slot first)."""
        self.pool.clear(slot)
        heapq.heappush(self._free_slots, slot)

    # ---- adapters managed from code (the engine's add_lora / list_loras / pin_lora) ------------------
    @property
    def _host_keep(self) -> set[int]:
        """Ids the host cache evicts last: the next waiting requests' adapters and the kept ones."""
        return self._lookahead_set | self._kept if self._kept else self._lookahead_set

    def is_registered(self, adapter_id: int) -> bool:
        """Known by a path (read, being read or queued for a read) and not removed."""
        if adapter_id in self._pending_removal:
            return False
        return (adapter_id in self._paths and adapter_id not in self._removed) or adapter_id in self._loading \
            or adapter_id in self._queued

    def registration(self, adapter_id: int) -> tuple[str, str] | None:
        """(name, directory) of a registered adapter, as a LoRA request gave them; None: not registered."""
        if not self.is_registered(adapter_id):
            return None
        pending = self._loading.get(adapter_id)
        if pending is not None:
            return pending.name, pending.path
        path = self._queued.get(adapter_id) or self._paths[adapter_id]
        return self._names.get(adapter_id, f"lora-{adapter_id}"), path

    def loaded_adapter_ids(self) -> set[int]:
        """Adapters whose weights are here (host memory or a GPU slot), and the kept ones; not those removed."""
        ids = set(self.host_cache.ids()) | set(self._slot_of) | self._kept
        return ids - self._pending_removal

    def kept_adapter_ids(self) -> set[int]:
        """Adapters pinned by ``keep_resident``: each holds a slot, or takes one at the next ``prefetch_slots``."""
        return self._kept

    def keep_resident(self, adapter_id: int) -> None:
        """Pin a registered adapter in a GPU slot until ``remove_adapter`` (vLLM's ``pin_lora``): never evicted from
        its slot, evicted from host memory last. It takes a slot now when one is free or held by an adapter no
        running request uses, else at a later step. ValueError for an id not registered, and for a pin that would
        leave no slot to the other adapters (the scheduler admits those into the slots the kept ones leave)."""
        if adapter_id in self._kept:
            return
        if not self.is_registered(adapter_id):
            raise ValueError(f"lora_int_id {adapter_id} is not registered: add it first (add_lora, or a request "
                             "that uses it)")
        if len(self._kept) + 1 >= self.max_loras:
            raise ValueError(f"lora_int_id {adapter_id}: {len(self._kept)} of max_loras={self.max_loras} GPU slots "
                             "are pinned already; one must stay for the other adapters (remove a pinned adapter, or "
                             "start the engine with a larger max_loras)")
        adapter = None
        if adapter_id not in self._slot_of and adapter_id in self._paths:  # (else resident, or still being read)
            # AdapterError here (its files changed or went away) leaves it unpinned
            adapter = self.host_cache.get(adapter_id) or self._read(adapter_id, self._paths[adapter_id])
        self._kept.add(adapter_id)
        self.acquire(adapter_id)
        slot = self._take_slot(avoid=self._lookahead_set, strict=False) if adapter is not None else None
        if slot is not None:
            self._place(adapter_id, slot, adapter)  # else ``prefetch_slots`` gives it one at a later step

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

    def prepare_step(self, token_adapter_ids: torch.Tensor, adapter_ids=None,
                     slot_of: dict[int, int] | None = None, has_base_tokens: bool = True,
                     pure_decode: bool = False, long_tokens: int | None = None) -> LoRAStep:
        """Give every adapter of the step a slot and build the step's mapping.

        ``adapter_ids`` (optional) lists the step's distinct adapter ids as known on the host; without it
        they are read from the tensor (one device->host sync). ``slot_of``: the slots ``assign_slots`` already
        gave them this step (skips assigning again). ``pure_decode``: one token per sequence (the in-GEMM shrink
        may apply, ``gemm_shrink_width``). ``long_tokens``: the step's tokens in requests of more than 32 of them (the
        kernel tiles follow where most tokens are, with ``segment_tiles``; None: unknown).
        """
        if slot_of is None:
            if adapter_ids is None:
                adapter_ids = torch.unique(token_adapter_ids).tolist()
            slot_of = self.assign_slots(adapter_ids)
        width = self.gemm_shrink_width(token_adapter_ids.shape[0], slot_of.values()) if pure_decode else None
        return self.make_step(token_slots_from_ids(token_adapter_ids, slot_of), len(slot_of), has_base_tokens,
                              gemm_slots=width, long_tokens=long_tokens if self.segment_tiles else None)

    def make_step(self, token_slots: torch.Tensor, num_active: int, has_base_tokens: bool = True,
                  gemm_slots: int | None = None, long_tokens: int | None = None) -> LoRAStep:
        """A step's mapping over this manager's pool and kernel options (slots already assigned);
        ``has_base_tokens`` (host-known; True when unknown) whether some token of the step has no adapter;
        ``gemm_slots``: the folded projections' shrinks inside their base GEMMs, over that many first slots
        (``gemm_shrink_width`` decides; None: the usual shrink kernels); the step's kernels are then planned for at
        most that many adapters, as in the configuration measured (run 29: ``max_loras`` = 32)."""
        fuse = fuses_silu_mul(self.fuse_silu_mul, self.silu_mul_min_tokens, token_slots.shape[0])
        return LoRAStep(self.pool, token_slots, num_active, self.use_triton, fuse, self.overlap_shrink,
                        self.expand_first_min_tokens, has_base_tokens,
                        gemm_shrink=bool(gemm_slots) and bool(self.pool.folded), gemm_slots=gemm_slots,
                        long_tokens=long_tokens, max_adapters=gemm_slots,
                        fold_shrink=folds_shrink(self.fold_shrink_max_tokens, token_slots.shape[0]))

    def warmup_steps(self, max_tokens: int) -> list[tuple[int, int, bool, int | None]]:
        """The eager steps a start-up warm-up runs so that no serving step compiles a LoRA kernel variant
        (``mapping.warmup_steps`` under this manager's options); empty where the kernels are not Triton's."""
        if not self.use_triton:
            return []
        return warmup_steps(self.shapes, self.kernel_options(), max_tokens)

    def kernel_options(self) -> StepKernelOptions:
        from loraplex.kernels.lora_shrink import pdl_supported

        return StepKernelOptions(self.max_loras, self.pool.max_rank, pdl_supported(self.device),
                                 self.expand_first_min_tokens, self.silu_mul_min_tokens, self.fuse_silu_mul,
                                 self.segment_tiles, self.fold_shrink_max_tokens)

    def gemm_shrink_widths(self, num_tokens: int) -> tuple[int, ...]:
        """The GEMM widths the in-GEMM shrink may use for a pure-decode step of ``num_tokens`` rows
        (``gemm_shrink_widths``); none without folded weights or above ``gemm_shrink_max_tokens``. The decode graphs
        keep a variant per width."""
        if not self.pool.folded or not 0 < num_tokens <= self.gemm_shrink_max_tokens:
            return ()
        return gemm_shrink_widths(self.max_loras, num_tokens)

    def gemm_shrink_width(self, num_tokens: int, slots: Iterable[int]) -> int | None:
        """The in-GEMM shrink's width for a pure-decode step of ``num_tokens`` rows whose adapters sit in ``slots``:
        the narrowest of ``gemm_shrink_widths`` above the highest slot, when the step's adapters fill at least half
        of it; None (the usual shrink kernels) otherwise. The GEMM computes y for every slot below the width, used
        or not, at cuBLAS's rate and without the shrink's launch (run 18: at 64 tokens on 64 slots the crossover
        is near 27 adapters)."""
        slots = list(slots)
        if not slots:
            return None
        top = max(slots)
        for width in self.gemm_shrink_widths(num_tokens):
            if width > top:
                if 2 * len(slots) < width:
                    return None
                self.num_gemm_shrink_steps += 1
                return width
        return None

    def assign_slots(self, adapter_ids, decode_tokens: int | None = None) -> dict[int, int]:
        """Give every adapter of a step (ids, 0 = base, ignored) a GPU slot; returns adapter id -> slot.

        Host bookkeeping plus asynchronous slot fills; the current stream then waits for the fills of these
        slots only. ``prepare_step`` uses it; the engine's CUDA-graph decode path calls it alone, writes the
        per-token slots into a static buffer and derives the kernel metadata inside the graph.

        ``decode_tokens``: the rows of a pure-decode step (its graph bucket), which may take the in-GEMM shrink.
        Adapters get the lowest free slot, but once the slots have filled, the first W hold adapters that no longer
        run while some of the step's sit above: ``_gather_low`` moves up to ``gemm_shrink_max_moves`` of them down."""
        step_ids = sorted({int(a) for a in adapter_ids if a})
        if len(step_ids) > self.max_loras:
            raise RuntimeError(f"{len(step_ids)} adapters in one step, over max_loras={self.max_loras}")
        for adapter_id in step_ids:
            self._ensure_slot(adapter_id, step_ids)
        if decode_tokens and self.gemm_shrink_max_moves and step_ids:
            self._gather_low(step_ids, decode_tokens)
        slot_of = {a: self._slot_of[a] for a in step_ids}
        self.pool.wait_for_fills(slot_of.values())
        return slot_of

    def _gather_low(self, step_ids: list[int], num_tokens: int) -> None:
        """Move adapters of a decode step that sit at or above the GEMM width W its adapters could fill (the narrowest
        of ``gemm_shrink_widths`` that holds them all, if they fill half of it) into the slots below W: a free slot,
        else swapped with the adapter there that ran least recently (it stays resident). At most
        ``gemm_shrink_max_moves`` a step; the rest move in later steps (a step with any left takes the usual shrink
        kernels). Each move is one or two copies of a slot on the device (``SlotPool.move``)."""
        count = len(step_ids)
        width = next((w for w in self.gemm_shrink_widths(num_tokens) if w >= count), None)
        if width is None or 2 * count < width:
            return
        high = [a for a in step_ids if self._slot_of[a] >= width][:self.gemm_shrink_max_moves]
        if not high:
            return
        in_step = set(step_ids)
        idle_low = (a for a in list(self._slot_lru) if a not in in_step and self._slot_of[a] < width)
        for adapter_id in high:
            src = self._slot_of[adapter_id]
            if self._free_slots and self._free_slots[0] < width:
                dst = heapq.heappop(self._free_slots)
                self.pool.move(src, dst, swap=False)
                self._free_slot(src)
            else:
                other = next(idle_low)  # count <= width: a slot below W holds no adapter of the step
                dst = self._slot_of[other]
                self.pool.move(src, dst, swap=True)
                self._slot_of[other] = src
            self._slot_of[adapter_id] = dst
            self.num_slot_moves += 1
        log.debug("%d adapters of a %d-token decode step moved below slot %d", len(high), num_tokens, width)

    def prefetch_slots(self) -> int:
        """Fill slots ahead of need, once per step after the running adapters are pinned: adapters of the
        first waiting requests (``poll``'s order) that are in host memory take a free slot, or the slot of
        the least recently used adapter that no running request pins and no request of that window needs.
        On CUDA the fills overlap the step about to run; the host never waits here: when the fills' staging
        buffers are full (``SlotPool.can_fill_now``), the rest waits for a later step. Returns the number of fills."""
        window = self._lookahead[:self.max_loras]
        if self._kept:  # kept adapters not yet resident come first: their slot is reserved by the scheduler
            window = sorted(a for a in self._kept if a not in self._slot_of) + window
        wanted = set(window)
        num = 0
        for adapter_id in window:
            if adapter_id in self._slot_of:
                continue
            adapter = self.host_cache.get(adapter_id)
            if adapter is None:
                continue
            if not self.pool.can_fill_now(adapter):
                self.num_prefetch_deferrals += 1
                break  # staging is full: the next step goes on (a fill here would stall the engine thread)
            slot = self._take_slot(avoid=wanted, strict=True)
            if slot is None:
                break
            self._place(adapter_id, slot, adapter)
            num += 1
        self.num_prefetched_loads += num
        return num

    def _ensure_slot(self, adapter_id: int, step_ids: list[int]) -> int:
        slot = self._slot_of.get(adapter_id)
        if slot is not None:
            self._slot_lru.move_to_end(adapter_id)
            return slot
        adapter = self.host_cache.get(adapter_id)
        if adapter is None:  # the scheduler admits only ready adapters; direct callers may skip that
            path = self._paths.get(adapter_id)
            if path is None:
                raise KeyError(f"adapter {adapter_id} was never prefetched (validate_and_prefetch first)")
            adapter = self._read(adapter_id, path)  # AdapterError if its files changed or disappeared
        slot = self._take_slot(avoid=set(step_ids) | self._lookahead_set, strict=False, step_ids=step_ids)
        if slot is None:
            raise RuntimeError("no GPU slot can be freed: every slot holds an adapter of this step or a running "
                               f"request (max_loras={self.max_loras}); the scheduler must keep within it")
        self._place(adapter_id, slot, adapter)
        return slot

    def _take_slot(self, avoid: set[int], strict: bool, step_ids: Iterable[int] = ()) -> int | None:
        """A free slot, else the slot of the least recently used unpinned adapter not in ``avoid`` (with
        ``strict=False``, one in ``avoid`` but not in ``step_ids`` when there is no other)."""
        if self._free_slots:
            return heapq.heappop(self._free_slots)
        unpinned = [a for a in self._slot_lru if not self._pins.get(a)]  # least recently used first
        victim = next((a for a in unpinned if a not in avoid), None)
        if victim is None and not strict:
            in_step = set(step_ids)
            victim = next((a for a in unpinned if a not in in_step), None)
        if victim is None:
            return None
        slot = self._slot_of.pop(victim)
        del self._slot_lru[victim]
        self.num_evictions += 1
        log.info("adapter %d evicted from slot %d", victim, slot)
        return slot

    def _place(self, adapter_id: int, slot: int, adapter: HostAdapter) -> None:
        self.pool.fill(slot, adapter)
        self._slot_of[adapter_id] = slot
        self._slot_lru[adapter_id] = None
        self.num_loads += 1
