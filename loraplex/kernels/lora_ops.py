"""Launch policy for the LoRA kernels: decode (BGMV-like) vs prefill (SGMV-like) regimes, split-K.

Decode steps have about one token per adapter: chunks of 16 tokens (the smallest ``tl.dot`` tile), narrow
rank tiles so small ranks waste nothing, and split-K over the long hidden dimension so the few
(chunk, slice) programs still fill the GPU. Prefill steps have long segments per adapter: chunks of 64
tokens and a rank tile covering the whole rank so x is read once per chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from loraplex.kernels.lora_expand import lora_expand
from loraplex.kernels.lora_meta import LoRAKernelMeta, max_chunks_for
from loraplex.kernels.lora_shrink import lora_shrink

TARGET_PROGRAMS = 264  # ~2 waves of an H200's 132 SMs


@dataclass(frozen=True)
class LoRAKernelConfig:
    block_m: int
    block_r: int  # shrink rank tile
    block_k: int  # shrink K tile
    split_k: int
    block_n: int  # expand N tile
    shrink_warps: int = 4
    shrink_stages: int = 3
    expand_warps: int = 4


def choose_config(num_tokens: int, num_active_slots: int, num_slots: int, max_rank: int,
                  k_dim: int, num_slices: int = 3) -> LoRAKernelConfig:
    """Pick tiles from host-known sizes only (token count, distinct adapters), never device values."""
    per_adapter = num_tokens / max(1, num_active_slots)
    rank_pow2 = max(16, triton.next_power_of_2(max_rank))
    if per_adapter <= 32:
        block_m, block_r, block_k = 16, 16, 128
    else:
        block_m, block_r, block_k = 64, min(64, rank_pow2), 64
    chunks = max_chunks_for(num_tokens, num_slots, block_m)
    active_chunks = min(chunks, -(-num_tokens // block_m) + num_active_slots)
    programs = max(1, active_chunks * num_slices * triton.cdiv(max_rank, block_r))
    split_k = 1
    while programs * split_k < TARGET_PROGRAMS and k_dim // (split_k * 2) >= 4 * block_k and split_k < 16:
        split_k *= 2
    return LoRAKernelConfig(block_m=block_m, block_r=block_r, block_k=block_k, split_k=split_k, block_n=128)


def lora_apply(
    x: torch.Tensor,  # [T, K]
    out: torch.Tensor,  # [T, N_total], updated in place
    lora_a: torch.Tensor,  # [num_slots, S, R, K]
    lora_b: torch.Tensor,  # [num_slots, R, N_total]
    ranks: torch.Tensor,  # [S, num_slots] int32
    scaling: torch.Tensor,  # [num_slots] float32
    slice_loc: torch.Tensor,  # [S + 1] int32 (device)
    max_slice_width: int,
    meta: LoRAKernelMeta,
    cfg: LoRAKernelConfig,
    scratch: torch.Tensor | None = None,  # [>=split_k, >=S, T, R] float32
) -> torch.Tensor:
    """Semantics: ``lora_ref.lora_apply_ref`` (shrink, then expand with the split-K reduce fused in)."""
    assert meta.block_m == cfg.block_m, "metadata was built for another chunk size"
    y = lora_shrink(x, lora_a, ranks, meta, split_k=cfg.split_k, block_r=cfg.block_r, block_k=cfg.block_k,
                    y=scratch, num_warps=cfg.shrink_warps, num_stages=cfg.shrink_stages)
    return lora_expand(y, lora_b, ranks, scaling, slice_loc, max_slice_width, meta, out, block_n=cfg.block_n,
                       num_warps=cfg.expand_warps)
