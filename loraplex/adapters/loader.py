"""Load a validated PEFT adapter into host memory, already in the slot pool's layout.

Per fused projection (``qkv``, ``o``, ``gate_up``, ``down``) with S slices, K inputs and N_total outputs:

    a    [L, S, r, K]        lora_A of every layer and slice (zeros where the adapter has no weights)
    bt   [L, r, N_total]     lora_B transposed, slices side by side
    ranks [L, 7] int32       r where (layer, module) carries weights, else 0 (the kernels skip it)

so filling a GPU slot is one contiguous copy per projection (from pinned memory on CUDA).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from loraplex.adapters.modules import MODULE_INDEX, MODULES, PROJ_MODULES, BaseShapes
from loraplex.adapters.validate import AdapterSpec, read_adapter


@dataclass
class HostAdapter:
    adapter_id: int  # the id that first read these files; ids naming the same unchanged files share this object
    spec: AdapterSpec
    a: dict[str, torch.Tensor | None]  # proj -> [L, S, r, K]; None when no slice is targeted
    bt: dict[str, torch.Tensor | None]  # proj -> [L, r, N_total]
    ranks: torch.Tensor  # [L, 7] int32

    @property
    def rank(self) -> int:
        return self.spec.rank

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.a.values(), *self.bt.values()) if t is not None)


def load_adapter(adapter_id: int, path: str | Path, base_config: Any, max_rank: int, *,
                 dtype: torch.dtype, pin_memory: bool = False, **limits) -> HostAdapter:
    """Validate (values included) and lay the weights out for the slot pool. Raises AdapterError."""
    shapes = BaseShapes.from_config(base_config)
    spec, tensors = read_adapter(path, shapes, max_rank, keep_tensors=True, **limits)
    r, num_layers = spec.rank, shapes.num_layers
    ranks = torch.zeros(num_layers, len(MODULES), dtype=torch.int32)
    a_out: dict[str, torch.Tensor | None] = {}
    bt_out: dict[str, torch.Tensor | None] = {}
    for proj, modules in PROJ_MODULES.items():
        if not any(m in spec.module_layers for m in modules):
            a_out[proj] = bt_out[proj] = None
            continue
        widths = shapes.slice_widths(proj)
        a = torch.zeros(num_layers, len(modules), r, shapes.proj_in(proj), dtype=dtype)
        bt = torch.zeros(num_layers, r, sum(widths), dtype=dtype)
        col = 0
        for s, (module, width) in enumerate(zip(modules, widths)):
            for layer in spec.module_layers.get(module, ()):
                lora_a, lora_b = tensors[(layer, module)]
                a[layer, s] = lora_a.to(dtype)
                bt[layer, :, col:col + width] = lora_b.t().to(dtype)
                ranks[layer, MODULE_INDEX[module]] = r
            col += width
        a_out[proj] = a.pin_memory() if pin_memory else a
        bt_out[proj] = bt.pin_memory() if pin_memory else bt
    return HostAdapter(adapter_id=adapter_id, spec=spec, a=a_out, bt=bt_out,
                       ranks=ranks.pin_memory() if pin_memory else ranks)
