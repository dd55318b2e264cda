"""GPU slot pool: ``max_loras`` slots of adapter weights, stacked per layer and fused projection.

Shape (per proj in qkv, o, gate_up, down, with S slices, K inputs, N_total outputs, R = max_lora_rank):
    a[proj]    [L, max_loras, S, R, K]     rank rows packed first: slot l's adapter of rank r fills [:r]
    bt[proj]   [L, max_loras, R, N_total]
    ranks      [L, 7, max_loras] int32     real rank per (layer, module, slot); 0 = nothing to add
    scaling    [max_loras] float32

Rows beyond an adapter's rank are never read (the kernels clamp to ``ranks``), so a slot is refilled
without zeroing and mixed ranks cost only their own rank.

Fills on CUDA: a packed adapter (``packed.py``) is one host->device transfer into a staging buffer, then a
few device-side copies into the slot. The transfer goes on the copy stream at once: it touches nothing a
queued step reads, so it overlaps whatever the GPU is running (the running step, and with overlapped steps the
one queued behind it). Only the device-side copies run on the scatter stream after every kernel already
queued on the current stream (readers of the slot's previous occupant). Each fill records one event:
``wait_for_fills(slots)`` makes the current stream wait for the fills of those slots only, so a fill ahead of
need overlaps the steps before it, and a fill just in time costs its step the device-side copies (tens of
microseconds), not the PCIe transfer (milliseconds: 84 MB for a rank-16 adapter of an 8B model). Staging
buffers still waiting for their copies are bounded (``max_staged_bytes``): past it a fill waits on the host for
the oldest, and slot prefetch (``can_fill_now``) stops for that step instead. Tensors are filled in place and never reallocated (captured CUDA graphs read them).
"""

from __future__ import annotations

from collections import deque

import torch

from loraplex.adapters.loader import HostAdapter
from loraplex.adapters.modules import MODULE_INDEX, PROJ_MODULES, BaseShapes
from loraplex.adapters.packed import PackedAdapter

# staging buffers of fills whose device-side copies have not run yet: at most this many bytes (and at least one
# buffer) before a fill waits on the host for the oldest
MAX_STAGED_BYTES = 2 << 30


class SlotPool:
    def __init__(self, shapes: BaseShapes, max_loras: int, max_rank: int, device: torch.device,
                 dtype: torch.dtype, max_staged_bytes: int = MAX_STAGED_BYTES) -> None:
        self.shapes = shapes
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.device = torch.device(device)
        self.dtype = dtype
        num_layers = shapes.num_layers
        self.a = {p: torch.zeros(num_layers, max_loras, len(mods), max_rank, shapes.proj_in(p), dtype=dtype,
                                 device=self.device) for p, mods in PROJ_MODULES.items()}
        self.bt = {p: torch.zeros(num_layers, max_loras, max_rank, sum(shapes.slice_widths(p)), dtype=dtype,
                                  device=self.device) for p in PROJ_MODULES}
        self.ranks = torch.zeros(num_layers, len(MODULE_INDEX), max_loras, dtype=torch.int32, device=self.device)
        self.scaling = torch.zeros(max_loras, dtype=torch.float32, device=self.device)
        # slice column offsets per proj: device copy for the kernels, host copy for the twins
        self.slice_loc_host: dict[str, list[int]] = {}
        self.slice_loc: dict[str, torch.Tensor] = {}
        for p in PROJ_MODULES:
            loc = [0]
            for w in shapes.slice_widths(p):
                loc.append(loc[-1] + w)
            self.slice_loc_host[p] = loc
            self.slice_loc[p] = torch.tensor(loc, dtype=torch.int32, device=self.device)
        self.module_range = {p: (MODULE_INDEX[m[0]], MODULE_INDEX[m[0]] + len(m))
                                   for p, m in PROJ_MODULES.items()}
        # layer_view's views, made once: every eager step asks for each (projection, layer) again, and the buffers
        # above are filled in place, never replaced
        self._layer_views: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        cuda = self.device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(self.device) if cuda else None  # host->device transfers only
        self._scatter_stream = torch.cuda.Stream(self.device) if cuda else None  # staged -> slot copies
        self.max_staged_bytes = max_staged_bytes
        self._staged: deque[tuple[torch.cuda.Event, int]] = deque()  # (scatter done, staged bytes), oldest first
        self._staged_bytes = 0
        # slot -> (event recorded after its last fill, its host adapter): the reference keeps the host copy alive
        # at least until a step waits for the fill (torch's pinned allocator also holds a buffer that an
        # in-flight copy reads)
        self._pending_fills: dict[int, tuple[torch.cuda.Event, HostAdapter]] = {}
        self.fill_version = [0] * max_loras  # per slot, +1 on every fill or clear (copies of a slot check it)
        # projections whose A rows sit under the base weight in one tensor (``fold_base_weights``): proj -> (
        # [L, N + max_loras * S * R, K], N)
        self.folded: dict[str, tuple[torch.Tensor, int]] = {}

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.a.values(), *self.bt.values()))

    def fill(self, slot: int, adapter: HostAdapter) -> None:
        """Copy an adapter into a slot: synchronous on the CPU, queued on the copy stream on CUDA."""
        assert 0 <= slot < self.max_loras and adapter.rank <= self.max_rank
        self.fill_version[slot] += 1
        if self._copy_stream is None:
            self._write(slot, adapter.rank, _sources(adapter))
            return
        scatter = self._scatter_stream
        staged = None
        if isinstance(adapter, PackedAdapter):
            self._bound_staging(adapter.buffer.numel())
            with torch.cuda.stream(self._copy_stream):
                # the PCIe transfer: needs nothing queued before it, so it starts now
                staged = adapter.buffer.to(self.device, non_blocking=True)
                transferred = torch.cuda.Event()
                transferred.record(self._copy_stream)
            scatter.wait_event(transferred)
            sources = adapter.device_views(staged)
        else:
            sources = _sources(adapter)
        scatter.wait_stream(torch.cuda.current_stream(self.device))  # readers of the previous occupant
        with torch.cuda.stream(scatter):
            self._write(slot, adapter.rank, sources)
            event = torch.cuda.Event()
            event.record(scatter)
        if staged is not None:
            staged.record_stream(scatter)  # the allocator keeps it until the copies out of it have run
            self._staged.append((event, staged.numel()))
            self._staged_bytes += staged.numel()
        self._pending_fills[slot] = (event, adapter)

    def can_fill_now(self, adapter: HostAdapter) -> bool:
        """Whether ``fill(slot, adapter)`` would queue without the host waiting for staged copies (always on the
        CPU and for unpacked adapters). Slot prefetch asks first: a fill ahead of need must never stall the engine
        thread, whose next step would then start late."""
        if self._copy_stream is None or not isinstance(adapter, PackedAdapter):
            return True
        while self._staged and self._staged[0][0].query():
            _, size = self._staged.popleft()
            self._staged_bytes -= size
        return not self._staged or self._staged_bytes + adapter.buffer.numel() <= self.max_staged_bytes

    def _bound_staging(self, nbytes: int) -> None:
        """Forget staging buffers whose copies have run; wait on the host for the oldest while the rest would
        exceed ``max_staged_bytes`` (the device memory that fills just in time may hold at once)."""
        while self._staged and (self._staged[0][0].query()
                                or self._staged_bytes + nbytes > self.max_staged_bytes):
            event, size = self._staged.popleft()
            event.synchronize()
            self._staged_bytes -= size

    def wait_for_fills(self, slots) -> None:
        """Order the current stream after the fills of these slots (no-op on the CPU or when filled)."""
        if not self._pending_fills:
            return
        current = None
        for slot in slots:
            pending = self._pending_fills.pop(slot, None)
            if pending is not None:
                current = current or torch.cuda.current_stream(self.device)
                current.wait_event(pending[0])

    @property
    def num_pending_fills(self) -> int:
        """Fills queued that no step has waited for yet (prefetched slots not yet used)."""
        return len(self._pending_fills)

    def _write(self, slot: int, r: int, src: dict) -> None:
        non_blocking = self.device.type == "cuda"
        for proj in PROJ_MODULES:
            a = src.get(f"a.{proj}")
            if a is None:
                continue
            self.a[proj][:, slot, :, :r].copy_(a, non_blocking=non_blocking)
            self.bt[proj][:, slot, :r].copy_(src[f"bt.{proj}"], non_blocking=non_blocking)
        self.ranks[:, :, slot].copy_(src["ranks"], non_blocking=non_blocking)
        scaling = src["scaling"]
        if isinstance(scaling, torch.Tensor):
            self.scaling[slot:slot + 1].copy_(scaling, non_blocking=non_blocking)
        else:
            self.scaling[slot] = scaling

    def move(self, src: int, dst: int, swap: bool) -> None:
        """Copy slot ``src``'s adapter into slot ``dst``; with ``swap``, ``dst``'s adapter goes to ``src`` (through a
        copy of one slot), otherwise ``src`` keeps a stale copy the caller treats as free. Device-side copies on the
        current stream, after every step queued on it (readers of both slots' previous contents) and after the
        fills queued for either slot; about 2 x 84 MB of traffic per copy for a rank-16 adapter of an 8B model, tens
        of microseconds on an H200. The in-GEMM shrink moves the adapters of a decode step into the first slots
        (``LoRAManager.assign_slots``)."""
        assert src != dst and 0 <= src < self.max_loras and 0 <= dst < self.max_loras
        self.wait_for_fills([src, dst])  # (a later fill waits for the current stream: it comes after these copies)
        for t, dim in [*((t, 1) for t in (*self.a.values(), *self.bt.values())), (self.ranks, 2), (self.scaling, 0)]:
            to, frm = t.select(dim, dst), t.select(dim, src)
            keep = to.clone() if swap else None
            to.copy_(frm)
            if keep is not None:
                frm.copy_(keep)
        self.fill_version[src] += 1
        self.fill_version[dst] += 1

    def clear(self, slot: int) -> None:
        self.wait_for_fills([slot])  # a fill still in flight would write the ranks back
        self.ranks[:, :, slot] = 0
        self.fill_version[slot] += 1

    def fold_base_weights(self, proj: str, weights: list[torch.Tensor]) -> list[torch.Tensor]:
        """Put every layer's base weight of ``proj`` [N, K] and the pool's A rows of all slots in one tensor
        [L, N + max_loras * S * R, K] (base rows first) and return the base weights as views of it, for the model
        to use instead. ``x @ folded[layer].T`` is then the base projection *and* every slot's shrink in one
        cuBLAS GEMM (``LoRAStep`` with ``gemm_shrink``); ``a[proj]`` becomes a view of the same tensor, so fills,
        the Triton shrink and the twins see no difference. Rows beyond an adapter's rank hold whatever was there
        (their products are computed and never read)."""
        if proj in self.folded:
            raise ValueError(f"{proj} is already folded")
        num_layers, _, num_slices, max_rank, k_dim = self.a[proj].shape
        if len(weights) != num_layers:
            raise ValueError(f"{proj}: {len(weights)} weights for {num_layers} layers")
        n = weights[0].shape[0]
        for w in weights:  # (the weights may sit elsewhere, e.g. staged in host memory: they are copied over)
            if w.shape != (n, k_dim) or w.dtype != self.dtype:
                raise ValueError(f"{proj}: a base weight of {tuple(w.shape)} {w.dtype}, want ({n}, {k_dim}) "
                                 f"{self.dtype}")
        rows = self.max_loras * num_slices * max_rank
        folded = torch.empty(num_layers, n + rows, k_dim, dtype=self.dtype, device=self.device)
        for i, w in enumerate(weights):
            folded[i, :n].copy_(w)
        folded[:, n:].copy_(self.a[proj].reshape(num_layers, rows, k_dim))
        self.a[proj] = folded[:, n:].view(num_layers, self.max_loras, num_slices, max_rank, k_dim)
        self.folded[proj] = (folded, n)
        self._layer_views = {k: v for k, v in self._layer_views.items() if k[0] != proj}
        return [folded[i, :n] for i in range(num_layers)]

    def layer_view(self, proj: str, layer: int):
        """(a [max_loras, S, R, K], bt [max_loras, R, N_total], ranks [S, max_loras]) of one layer."""
        views = self._layer_views.get((proj, layer))
        if views is None:
            lo, hi = self.module_range[proj]
            views = self._layer_views[(proj, layer)] = (self.a[proj][layer], self.bt[proj][layer],
                                                        self.ranks[layer, lo:hi])
        return views


def _sources(adapter: HostAdapter) -> dict:
    """An adapter's tensors under the names of a packed layout (``packed.py``)."""
    src: dict = {"ranks": adapter.ranks, "scaling": adapter.spec.scaling}
    for proj in PROJ_MODULES:
        if adapter.a.get(proj) is not None:
            src[f"a.{proj}"], src[f"bt.{proj}"] = adapter.a[proj], adapter.bt[proj]
    return src
