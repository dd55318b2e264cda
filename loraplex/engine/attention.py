"""Attention metadata built once per step, and the backend that stores KV and runs paged attention.

Backends share one interface: ``store_kv(key, value, kv, slot_mapping)`` and ``attention(query, kv, metadata,
scale)``, ``kv`` a layer's ``LayerKV`` (its key/value caches and, for an INT8 cache, their row scales). The CPU path calls the
pure-torch reference twins in ``loraplex.kernels.attention_ref``; a Triton backend for CUDA registers
itself in ``ATTENTION_BACKENDS`` under ``"triton"`` and is preferred on CUDA when present.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from loraplex.engine.kv_cache import LayerKV
from loraplex.kernels.attention_ref import paged_attention_ref, store_kv_ref


@dataclass
class AttentionMetadata:
    backend: AttentionBackend
    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset of each new token
    block_tables: torch.Tensor  # [B, max_blocks] int32
    query_start_loc: torch.Tensor  # [B + 1] int32: cumulative new-token counts
    seq_lens: torch.Tensor  # [B] int32: KV length of each sequence including its new tokens
    max_query_len: int
    max_seq_len: int
    # leading sequences with exactly one new token (the scheduler lists them first in a step with prompt chunks):
    # in a mixed step the Triton backend runs them through the split-KV decode kernel, the rest through the varlen
    # kernel
    num_decodes: int = 0
    # query_start_loc[num_decodes:] - num_decodes (the varlen part's offsets), made once per step; None: each call
    # makes it
    rest_query_start_loc: torch.Tensor | None = None
    # seq_lens[num_decodes:] and block_tables[num_decodes:] copied into tensors of their own once per step (16-byte
    # aligned, so the varlen kernel is always the variant that the warm-up compiled); None: slices
    rest_seq_lens: torch.Tensor | None = None
    rest_block_tables: torch.Tensor | None = None


class AttentionBackend:
    name = "base"

    def store_kv(self, key, value, kv: LayerKV, slot_mapping) -> None:
        raise NotImplementedError

    def attention(self, query, kv: LayerKV, meta: AttentionMetadata, scale: float,
                  out: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of the new tokens [T, Hq, D]; written into ``out`` (same shape) when given."""
        raise NotImplementedError


class TorchAttentionBackend(AttentionBackend):
    """The reference twins: any device, one varlen causal call for mixed prefill and decode."""

    name = "torch"

    def store_kv(self, key, value, kv, slot_mapping) -> None:
        store_kv_ref(key, value, kv.key, kv.value, slot_mapping, **kv.scales)

    def attention(self, query, kv, meta, scale, out=None):
        result = paged_attention_ref(query, kv.key, kv.value, meta.block_tables, meta.query_start_loc,
                                     meta.seq_lens, scale, **kv.scales)
        if out is None:
            return result
        return out.copy_(result)


class TritonAttentionBackend(AttentionBackend):
    """CUDA kernels with the reference's signatures (``loraplex.kernels.paged_attention`` / ``kv_store``)."""

    name = "triton"

    def __init__(self):
        from loraplex.kernels.kv_store import store_kv
        from loraplex.kernels.paged_attention import paged_attention

        self._store_kv, self._paged_attention = store_kv, paged_attention

    def store_kv(self, key, value, kv, slot_mapping) -> None:
        self._store_kv(key, value, kv.key, kv.value, slot_mapping, **kv.scales)

    def attention(self, query, kv, meta, scale, out=None):
        return self._paged_attention(query, kv.key, kv.value, meta.block_tables, meta.query_start_loc,
                                     meta.seq_lens, scale, out=out, max_query_len=meta.max_query_len,
                                     max_seq_len=meta.max_seq_len, num_decodes=meta.num_decodes,
                                     rest_query_start_loc=meta.rest_query_start_loc,
                                     rest_seq_lens=meta.rest_seq_lens, rest_block_tables=meta.rest_block_tables,
                                     **kv.scales)


ATTENTION_BACKENDS: dict[str, Callable[[], AttentionBackend]] = {
    "torch": TorchAttentionBackend, "triton": TritonAttentionBackend}


def get_attention_backend(device: torch.device | str, name: str | None = None) -> AttentionBackend:
    """``name`` forces a backend; otherwise Triton on CUDA, else the torch reference."""
    if name is None:
        name = "triton" if torch.device(device).type == "cuda" else "torch"
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend {name!r} is not available (have: {', '.join(ATTENTION_BACKENDS)})")
    return ATTENTION_BACKENDS[name]()
