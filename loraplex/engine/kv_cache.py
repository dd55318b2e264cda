"""One layer's paged KV cache, as the model, the attention backends and the graph runners pass it around."""

from __future__ import annotations

from typing import NamedTuple

import torch


class LayerKV(NamedTuple):
    """``key``/``value`` [num_blocks, block_size, Hkv, D] in the cache's element type (the model's dtype, float8
    e4m3 or int8); for an INT8 cache, ``key_scale``/``value_scale`` [num_blocks, block_size, Hkv] fp32 hold one
    scale per (token, KV head) row (``kv_cache_dtype="int8"``), else None."""

    key: torch.Tensor
    value: torch.Tensor
    key_scale: torch.Tensor | None = None
    value_scale: torch.Tensor | None = None

    @property
    def scales(self) -> dict:
        """Keyword arguments passing the scales to a kernel or twin (empty unless INT8)."""
        return {} if self.key_scale is None else {"key_scale": self.key_scale, "value_scale": self.value_scale}

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor indexed by block (what copy-on-write copies)."""
        return [t for t in self if t is not None]
