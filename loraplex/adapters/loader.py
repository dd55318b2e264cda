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


def proj_shapes(spec: AdapterSpec, shapes: BaseShapes) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """(a shape, bt shape) of each fused projection where the adapter has at least one slice."""
    r, num_layers = spec.rank, shapes.num_layers
    return {proj: ((num_layers, len(modules), r, shapes.proj_in(proj)), (num_layers, r, sum(shapes.slice_widths(proj))))
            for proj, modules in PROJ_MODULES.items() if any(m in spec.module_layers for m in modules)}


def fill_layout(spec: AdapterSpec, tensors: dict, shapes: BaseShapes, a: dict[str, torch.Tensor],
                bt: dict[str, torch.Tensor], ranks: torch.Tensor) -> None:
    """Copy (and cast) each (layer, module)'s lora_A and transposed lora_B into ``a``/``bt`` (one tensor per
    projection of ``proj_shapes``) and mark its rank; what the adapter leaves empty is not written."""
    for proj in a:
        col = 0
        for s, (module, width) in enumerate(zip(PROJ_MODULES[proj], shapes.slice_widths(proj))):
            for layer in spec.module_layers.get(module, ()):
                lora_a, lora_b = tensors[(layer, module)]
                a[proj][layer, s].copy_(lora_a)
                bt[proj][layer, :, col:col + width].copy_(lora_b.t())
                ranks[layer, MODULE_INDEX[module]] = spec.rank
            col += width


def load_adapter(adapter_id: int, path: str | Path, base_config: Any, max_rank: int, *,
                 dtype: torch.dtype, pin_memory: bool = False, **limits) -> HostAdapter:
    """Validate (values included) and lay the weights out for the slot pool. Raises AdapterError."""
    shapes = BaseShapes.from_config(base_config)
    spec, tensors = read_adapter(path, shapes, max_rank, keep_tensors=True, **limits)
    ranks = torch.zeros(shapes.num_layers, len(MODULES), dtype=torch.int32)
    layout = proj_shapes(spec, shapes)
    a = {proj: torch.zeros(a_shape, dtype=dtype) for proj, (a_shape, _) in layout.items()}
    bt = {proj: torch.zeros(bt_shape, dtype=dtype) for proj, (_, bt_shape) in layout.items()}
    fill_layout(spec, tensors, shapes, a, bt, ranks)

    def pinned(t: torch.Tensor | None) -> torch.Tensor | None:
        return t.pin_memory() if pin_memory and t is not None else t

    return HostAdapter(adapter_id=adapter_id, spec=spec, a={p: pinned(a.get(p)) for p in PROJ_MODULES},
                       bt={p: pinned(bt.get(p)) for p in PROJ_MODULES}, ranks=pinned(ranks))
