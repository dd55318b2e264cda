"""Launch policy for the LoRA kernels: decode (BGMV-like) vs prefill (SGMV-like) regimes, split-K.

Decode steps have about one token per adapter: chunks of 16 tokens (the smallest ``tl.dot`` tile), narrow
rank tiles so small ranks waste nothing, and split-K over the long hidden dimension so the few
(chunk, slice) programs still fill the GPU. Prefill steps have long segments per adapter: chunks of 64
tokens and a rank tile covering the whole rank so x is read once per chunk. The expand splits each slice's
columns so that enough programs run, each looping over several N tiles.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from loraplex.kernels.lora_expand import lora_expand
from loraplex.kernels.lora_meta import LoRAKernelMeta, max_chunks_for
from loraplex.kernels.lora_shrink import lora_shrink

# Small programs (a few KB to tens of KB each) need many in flight to keep HBM busy: on an H200 (132 SMs)
# the swept optimum of the decode shapes is around 8 programs per SM.
TARGET_PROGRAMS = 1024
MIN_K_PER_SPLIT = 512  # split-K below this leaves each program too few loads to pipeline


@dataclass(frozen=True)
class LoRAKernelConfig:
    block_m: int
    block_r: int  # shrink rank tile
    block_k: int  # shrink K tile
    split_k: int
    block_n: int  # expand N tile
    shrink_warps: int = 4
    shrink_stages: int = 3
    expand_splits: int | None = None  # expand programs per (chunk, slice) along N; None = one tile each
    expand_warps: int = 4
    expand_stages: int = 3


def choose_config(num_tokens: int, num_active_slots: int, num_slots: int, max_rank: int,
                  k_dim: int, num_slices: int = 3, max_slice_width: int | None = None) -> LoRAKernelConfig:
    """Pick tiles from host-known sizes only (token count, distinct adapters), never device values."""
    per_adapter = num_tokens / max(1, num_active_slots)
    rank_pow2 = max(16, triton.next_power_of_2(max_rank))
    decode = per_adapter <= 32
    if decode:
        block_m, block_r, block_k, shrink_warps, max_split = 16, 16, 128, 2, 16
    else:
        # long segments: x is re-read per rank tile, and y traffic grows with split-K
        block_m, block_r, block_k, shrink_warps, max_split = 64, min(64, rank_pow2), 64, 4, 2
    chunks = max_chunks_for(num_tokens, num_slots, block_m)
    active_chunks = max(1, min(chunks, -(-num_tokens // block_m) + num_active_slots))
    programs = active_chunks * num_slices * triton.cdiv(max_rank, block_r)
    split_k = 1
    while (programs * split_k < TARGET_PROGRAMS and k_dim // (split_k * 2) >= MIN_K_PER_SPLIT
           and split_k < max_split):
        split_k *= 2
    block_n = 128
    expand_splits = None
    if max_slice_width is not None:
        tiles = triton.cdiv(max_slice_width, block_n)
        expand_splits = min(tiles, triton.cdiv(TARGET_PROGRAMS, active_chunks * num_slices))
    return LoRAKernelConfig(block_m=block_m, block_r=block_r, block_k=block_k, split_k=split_k, block_n=block_n,
                            shrink_warps=shrink_warps, expand_splits=expand_splits)


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
                       n_splits=cfg.expand_splits, num_warps=cfg.expand_warps, num_stages=cfg.expand_stages)
