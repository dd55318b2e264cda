"""CUDA graphs for pure-decode steps (every scheduled sequence has exactly one new token).

Two graphs per batch bucket (base model only, and with adapters), captured at start-up by
``capture_all`` (largest first, all in one memory pool) or else the first time a step needs one. A step
of B sequences replays the graph of the smallest bucket >= B; the rows past B are padding: token 0,
slot -1 (the KV store skips it), sequence length 0 (attention reads no keys, output 0) and LoRA slot -1
(no adapter added). Sampling runs outside the graph on the first B rows of the captured hidden states.

Everything a graph reads lives in static device buffers written before each replay: input ids,
positions, slot mapping, block tables padded to ``max_blocks_per_seq`` columns, sequence lengths, query
offsets (``arange``: one token per row) and the LoRA per-token slots. The LoRA kernel metadata is built
from those slots inside the graph, and every grid is sized from buffer shapes (bucket, slot count),
never from a count seen at capture (KERNELS.md pitfalls 2, 3, 7): the attention split count ignores
host context lengths while capturing, and the LoRA chunk count depends only on the bucket and the slot
pool. The LoRA launch tiles are chosen for ``min(bucket, max_loras)`` distinct adapters (every row its
own adapter, the decode regime); they are correct for any mix, which only changes how well they fit.

``capture=False`` (the CPU, and tests) runs the same padded static-buffer forward without a graph, so
the padding logic is exercised everywhere.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging

import torch

from loraplex.engine.attention import AttentionBackend, AttentionMetadata
from loraplex.engine.step_inputs import StepBatch

log = logging.getLogger(__name__)

BASE_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


def graph_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes with a graph: the base list, steps of 64 past 256, always ending at max_num_seqs."""
    buckets = [b for b in BASE_BUCKETS if b < max_num_seqs]
    b = 320
    while b < max_num_seqs:
        buckets.append(b)
        b += 64
    buckets.append(max_num_seqs)
    return buckets


@contextlib.contextmanager
def gc_paused():
    """Python's cyclic GC collected first, then off while graphs are captured: a collection inside a capture could
    free objects of anything in the process (another engine's pinned adapter buffers, tensors used on other
    streams), and the CUDA calls such frees make (events recorded on the capturing stream, for one) must not join
    or void a capture. (``torch.cuda.graph`` collects before each capture for the same reason; the piecewise
    runner captures thousands of pieces with ``capture_begin`` directly.)"""
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@dataclasses.dataclass(frozen=True)
class GemmShrink:
    """The mode of a decode graph whose adapters' shrinks run inside the base GEMMs over the first ``slots`` slots
    (engine option lora_gemm_shrink, ``LoRAManager.gemm_shrink_width``): a third kind of value of a key's "with
    adapters" (truthy, so every "with adapters" test still holds)."""

    slots: int


class BucketedGraphs:
    """What both graph runners share: graphs keyed by (bucket, with adapters), the bucket of a size, and capturing
    every key at start-up. A subclass sets ``buckets`` (ascending), ``capture_graphs``, ``_graphs`` and
    implements ``_capture(key, lora_manager)``."""

    buckets: list[int]
    capture_graphs: bool
    _graphs: dict

    def bucket_for(self, size: int) -> int | None:
        """Smallest bucket >= size, or None when the size is larger than every bucket."""
        for b in self.buckets:
            if b >= size:
                return b
        return None

    def capture_all(self, lora_manager=None) -> None:
        """Capture every bucket now (with adapters too when a LoRA manager is given), largest first so the
        smaller graphs reuse the largest one's memory. No-op without ``capture``."""
        if not self.capture_graphs:
            return
        modes = (False, True) if lora_manager is not None else (False,)
        with gc_paused():
            for bucket in reversed(self.buckets):
                for with_lora in modes + self._extra_modes(bucket, lora_manager):
                    if (bucket, with_lora) not in self._graphs:
                        self._capture((bucket, with_lora), lora_manager)

    def _extra_modes(self, bucket: int, lora_manager) -> tuple:
        """More graph variants of a bucket than without / with adapters (the decode graphs: ``GemmShrink``)."""
        return ()

    def capture(self, key: tuple[int, bool | str], lora_manager) -> None:
        """Capture one key now (a key ``capture_all`` did not capture, first met in a step)."""
        with gc_paused():
            self._capture(key, lora_manager)

    def _capture(self, key: tuple[int, bool | str], lora_manager) -> None:
        raise NotImplementedError


class DecodeGraphRunner(BucketedGraphs):
    def __init__(self, model, kv_caches: list, backend: AttentionBackend, max_num_seqs: int,
                 max_blocks_per_seq: int, device: torch.device, capture: bool = True):
        self.model = model
        self.kv_caches = kv_caches
        self.backend = backend
        self.device = torch.device(device)
        self.capture_graphs = capture
        self.buckets = graph_buckets(max_num_seqs)
        self.max_batch = self.buckets[-1]
        n = self.max_batch
        dev = self.device
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=dev)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)  # never changes
        self.token_slots = torch.full((n,), -1, dtype=torch.int32, device=dev)
        pin = dev.type == "cuda" and torch.cuda.is_available()
        self._slots_host = torch.full((n,), -1, dtype=torch.int32, pin_memory=pin)
        self._graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph | None, torch.Tensor | None]] = {}
        self._pool = None
        self.num_replays = 0
        self.used_keys: set[tuple[int, bool]] = set()  # (bucket, with adapters) of the steps run so far

    @property
    def num_graphs(self) -> int:
        return sum(1 for g, _ in self._graphs.values() if g is not None)

    # ---- one step ------------------------------------------------------------------------------------
    def run(self, batch: StepBatch, lora_manager=None, slot_of: dict[int, int] | None = None,
            fixup=None, inputs_queued=None) -> torch.Tensor:
        """Final hidden states [B, H] of a pure-decode batch padded to its bucket (``batch.num_rows``).

        With adapters in the step, ``slot_of`` maps each adapter id to its GPU slot (already assigned).
        ``fixup(input_ids)`` (optional) edits the static input-id buffer on the device before the replay.
        ``inputs_queued()`` (optional) is called once every copy out of the batch's host buffers is queued,
        before the replay: the host may refill those buffers as soon as these copies have run, not the step."""
        assert batch.is_decode and batch.num_rows in self.buckets, "only padded pure-decode batches replay"
        bucket, num_seqs = batch.num_rows, batch.num_seqs
        key = (bucket, bool(slot_of))
        width = (lora_manager.gemm_shrink_width(bucket, slot_of.values())
                 if slot_of and lora_manager is not None else None)
        if width:
            key = (bucket, GemmShrink(width))
        if key not in self._graphs:
            self.capture(key, lora_manager)
        self._load_inputs(batch, slot_of if key[1] else None)
        if fixup is not None:
            fixup(self.input_ids)
        if inputs_queued is not None:
            inputs_queued()
        graph, hidden = self._graphs[key]
        if graph is None:
            hidden = self._forward(key, lora_manager)
        else:
            graph.replay()
        self.num_replays += 1
        self.used_keys.add(key)
        return hidden[:num_seqs]

    def _load_inputs(self, batch: StepBatch, slot_of: dict[int, int] | None) -> None:
        rows, num_seqs = batch.num_rows, batch.num_seqs
        nb = self.device.type == "cuda"
        self.input_ids[:rows].copy_(batch.input_ids, non_blocking=nb)
        self.positions[:rows].copy_(batch.positions, non_blocking=nb)
        self.slot_mapping[:rows].copy_(batch.slot_mapping, non_blocking=nb)
        self.seq_lens[:rows].copy_(batch.seq_lens, non_blocking=nb)
        width = batch.block_tables.shape[1]
        self.block_tables[:num_seqs, :width].copy_(batch.block_tables, non_blocking=nb)
        if slot_of is not None:
            host = self._slots_host.numpy()
            host[:num_seqs] = [slot_of.get(a, -1) for a in batch.lora_ids]
            host[num_seqs:rows] = -1
            self.token_slots[:rows].copy_(self._slots_host[:rows], non_blocking=nb)

    def _forward(self, key: tuple[int, bool | str], lora_manager) -> torch.Tensor:
        bucket, with_lora = key
        attn = AttentionMetadata(
            backend=self.backend, slot_mapping=self.slot_mapping[:bucket], block_tables=self.block_tables[:bucket],
            query_start_loc=self.query_start_loc[:bucket + 1], seq_lens=self.seq_lens[:bucket],
            max_query_len=1, max_seq_len=None)  # None: split count from shapes, right for any context
        lora = None
        if with_lora:
            # built here so that, under capture, the kernel metadata is derived from the static slots
            # kernels planned for at most as many adapters as there are slots below the in-GEMM shrink's width
            gemm = with_lora.slots if isinstance(with_lora, GemmShrink) else None
            lora = lora_manager.make_step(self.token_slots[:bucket], min(bucket, gemm or lora_manager.max_loras),
                                          gemm_slots=gemm)
        return self.model(self.input_ids[:bucket], self.positions[:bucket], self.kv_caches, attn, lora)

    def _extra_modes(self, bucket: int, lora_manager) -> tuple:
        if lora_manager is None:
            return ()
        return tuple(GemmShrink(w) for w in lora_manager.gemm_shrink_widths(bucket))

    # ---- capture -------------------------------------------------------------------------------------
    def _capture(self, key: tuple[int, bool | str], lora_manager) -> None:
        bucket = key[0]
        # padding everywhere: the warm-up runs must not write KV through slots left by an earlier step
        self.slot_mapping.fill_(-1)
        self.seq_lens.zero_()
        self.token_slots.fill_(-1)
        if not self.capture_graphs:
            self._graphs[key] = (None, None)
            return
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # compiles the Triton kernels and sets up cuBLAS outside the capture
                self._forward(key, lora_manager)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA calls of other threads (pinned host copies of adapters) must not void the capture
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            hidden = self._forward(key, lora_manager)
        self._graphs[key] = (graph, hidden)
        log.debug("captured decode CUDA graph: batch %d%s", bucket,
                  f" with adapters, in-GEMM shrink over {key[1].slots} slots" if isinstance(key[1], GemmShrink)
                  else " with adapters" if key[1] else "")

