"""One host buffer per adapter, so that a slot fill is one host->device copy.

``load_adapter`` lays an adapter out per fused projection (``a [L, S, r, K]``, ``bt [L, r, N_total]``,
``ranks [L, 7]``). ``pack_adapter`` moves all of it, plus the scaling as one float32, into a single byte
buffer (pinned on CUDA) and keeps the per-projection tensors as views into it. A fill then copies the
buffer to the device in one transfer and scatters it into the slot with a few device-side copies
(``SlotPool.fill``), instead of one host->device transfer per tensor.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from loraplex.adapters.loader import HostAdapter, fill_layout, proj_shapes
from loraplex.adapters.modules import MODULE_INDEX, PROJ_MODULES, BaseShapes
from loraplex.adapters.validate import read_adapter

log = logging.getLogger(__name__)

_ALIGN = 64  # bytes: every segment starts aligned for any dtype and for vectorized device copies


@dataclass(frozen=True)
class Segment:
    offset: int  # bytes into the buffer
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def num_bytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()

    def view(self, buffer: torch.Tensor) -> torch.Tensor:
        """This segment of a uint8 buffer (host or device) as a tensor of its shape and dtype."""
        return buffer[self.offset:self.offset + self.num_bytes].view(self.dtype).view(self.shape)


@dataclass
class PackedAdapter(HostAdapter):
    buffer: torch.Tensor  # uint8 [num_bytes], pinned on CUDA; a, bt, ranks are views into it
    layout: dict[str, Segment]  # "a.<proj>" | "bt.<proj>" | "ranks" | "scaling" -> its segment

    def device_views(self, staged: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every segment as a view of ``staged``, a copy of ``buffer`` (on the device)."""
        return {name: seg.view(staged) for name, seg in self.layout.items()}


def _layout(shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> tuple[dict[str, Segment], int]:
    layout: dict[str, Segment] = {}
    offset = 0
    for name, (shape, dtype) in shapes.items():
        layout[name] = Segment(offset, shape, dtype)
        offset += -(-layout[name].num_bytes // _ALIGN) * _ALIGN
    return layout, offset


def host_buffer(size: int, pin_memory: bool) -> torch.Tensor:
    """An adapter's host buffer: page-locked when asked (its upload to a slot is then an async copy); when the
    driver refuses the page-locked allocation, a pageable one (the upload is slower, the adapter still serves)."""
    if pin_memory:
        try:
            return torch.empty(size, dtype=torch.uint8, pin_memory=True)
        except RuntimeError as exc:  # torch.AcceleratorError: a CUDA error from cudaHostAlloc
            log.warning("page-locked host buffer of %d bytes refused (%s): using pageable memory", size, exc,
                        exc_info=exc)
    return torch.empty(size, dtype=torch.uint8)


def load_packed_adapter(adapter_id: int, path, shapes: BaseShapes, max_rank: int, *, dtype: torch.dtype,
                        pin_memory: bool, tp=None, **limits) -> PackedAdapter:
    """``pack_adapter(load_adapter(...))`` in one pass: the validated tensors are copied (and cast) straight into
    their place in the one buffer, and only the parts the adapter leaves empty are zeroed. Reading an adapter
    then costs one copy of its weights instead of three.

    ``tp``: (``parallel.TPInfo``, the whole model's shapes) under tensor parallelism: the files are validated
    against the whole model, then each module's pair is cut to this rank's part (``parallel.shard_lora_pair``)
    and laid out for ``shapes``, the rank's shard."""
    if tp is None:
        spec, tensors = read_adapter(path, shapes, max_rank, keep_tensors=True, **limits)
    else:
        from loraplex.engine.parallel import shard_lora_pair

        info, whole = tp
        spec, tensors = read_adapter(path, whole, max_rank, keep_tensors=True, **limits)
        tensors = {(layer, module): shard_lora_pair(module, a, b, info) for (layer, module), (a, b) in tensors.items()}
    projs = proj_shapes(spec, shapes)
    wanted: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for proj, (a_shape, bt_shape) in projs.items():
        wanted[f"a.{proj}"] = (a_shape, dtype)
        wanted[f"bt.{proj}"] = (bt_shape, dtype)
    wanted["ranks"] = ((shapes.num_layers, len(MODULE_INDEX)), torch.int32)
    wanted["scaling"] = ((1,), torch.float32)
    layout, size = _layout(wanted)
    buffer = host_buffer(size, pin_memory)
    views = {name: seg.view(buffer) for name, seg in layout.items()}
    a = {proj: views[f"a.{proj}"] for proj in projs}
    bt = {proj: views[f"bt.{proj}"] for proj in projs}
    views["ranks"].zero_()
    views["scaling"].fill_(spec.scaling)
    for proj in projs:
        if any(len(spec.module_layers.get(m, ())) < shapes.num_layers for m in PROJ_MODULES[proj]):
            a[proj].zero_()  # some (layer, slice) carries no weights: it must read as zeros
            bt[proj].zero_()
    fill_layout(spec, tensors, shapes, a, bt, views["ranks"])
    return PackedAdapter(adapter_id=adapter_id, spec=spec, a={p: a.get(p) for p in PROJ_MODULES},
                         bt={p: bt.get(p) for p in PROJ_MODULES}, ranks=views["ranks"], buffer=buffer, layout=layout)


def pack_adapter(adapter: HostAdapter, pin_memory: bool) -> PackedAdapter:
    """Copy an adapter into one (pinned) buffer; the result shares nothing with ``adapter``."""
    tensors: dict[str, torch.Tensor] = {}
    for proj, a in adapter.a.items():
        if a is not None:
            tensors[f"a.{proj}"] = a
            tensors[f"bt.{proj}"] = adapter.bt[proj]
    tensors["ranks"] = adapter.ranks
    tensors["scaling"] = torch.tensor([adapter.spec.scaling], dtype=torch.float32)
    layout, size = _layout({name: (tuple(t.shape), t.dtype) for name, t in tensors.items()})
    buffer = host_buffer(size, pin_memory)
    for name, t in tensors.items():
        layout[name].view(buffer).copy_(t)
    views = {name: seg.view(buffer) for name, seg in layout.items()}
    return PackedAdapter(
        adapter_id=adapter.adapter_id, spec=adapter.spec,
        a={p: views.get(f"a.{p}") for p in adapter.a}, bt={p: views.get(f"bt.{p}") for p in adapter.bt},
        ranks=views["ranks"], buffer=buffer, layout=layout)
