"""GPU slot pool: ``max_loras`` slots of adapter weights, stacked per layer and fused projection.

Shape (per proj in qkv, o, gate_up, down, with S slices, K inputs, N_total outputs, R = max_lora_rank):
    a[proj]    [L, max_loras, S, R, K]     rank rows packed first: slot l's adapter of rank r fills [:r]
    bt[proj]   [L, max_loras, R, N_total]
    ranks      [L, 7, max_loras] int32     real rank per (layer, module, slot); 0 = nothing to add
    scaling    [max_loras] float32

Rows beyond an adapter's rank are never read (the kernels clamp to ``ranks``), so a slot is refilled
without zeroing and mixed ranks cost only their own rank.
"""

from __future__ import annotations

import torch

from loraplex.adapters.loader import HostAdapter
from loraplex.adapters.modules import MODULE_INDEX, PROJ_MODULES, BaseShapes


class SlotPool:
    def __init__(self, shapes: BaseShapes, max_loras: int, max_rank: int, device: torch.device,
                 dtype: torch.dtype) -> None:
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
        self._proj_module_range = {p: (MODULE_INDEX[m[0]], MODULE_INDEX[m[0]] + len(m))
                                   for p, m in PROJ_MODULES.items()}

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.a.values(), *self.bt.values()))

    def fill(self, slot: int, adapter: HostAdapter) -> None:
        """Copy an adapter into a slot (asynchronous from pinned memory; stream order protects readers)."""
        r = adapter.rank
        assert 0 <= slot < self.max_loras and r <= self.max_rank
        non_blocking = self.device.type == "cuda"
        for proj in PROJ_MODULES:
            a, bt = adapter.a[proj], adapter.bt[proj]
            if a is None:
                continue
            self.a[proj][:, slot, :, :r].copy_(a, non_blocking=non_blocking)
            self.bt[proj][:, slot, :r].copy_(bt, non_blocking=non_blocking)
        self.ranks[:, :, slot].copy_(adapter.ranks, non_blocking=non_blocking)
        self.scaling[slot] = adapter.spec.scaling

    def clear(self, slot: int) -> None:
        self.ranks[:, :, slot] = 0

    def layer_view(self, proj: str, layer: int):
        """(a [max_loras, S, R, K], bt [max_loras, R, N_total], ranks [S, max_loras]) of one layer."""
        lo, hi = self._proj_module_range[proj]
        return self.a[proj][layer], self.bt[proj][layer], self.ranks[layer, lo:hi]
