"""A LoRA shrink folded into the launch that writes its input: one launch fewer per projection.

A decode step's LoRA work is eight small launches per layer (a shrink and an expand per projection), each paying
a few microseconds of launch and tail latency beyond its bytes (NOTES-lora.md: ~4 us a launch on the H200, 256
launches a step). The down projection's shrink reads x = silu(gate) * up, which the launch before the down GEMM,
SiLU-and-multiply, writes. Here one launch does both:

- the *row programs* write ``act = silu(gate) * up`` [T, I] exactly as ``fused_ops.silu_mul`` (same rounding,
  shared ``silu_mul_block``);
- the *shrink programs* (the same grid decomposition and split-K partials as ``lora_shrink``, so the expand that
  follows sums them unchanged) recompute their chunk's tile of act from gate|up as they read it, instead of
  waiting for the row programs (no grid-wide sync, no atomics: runs under ``TRITON_INTERPRET=1``).

Semantics (twins: ``silu_mul_ref`` and ``lora_shrink_ref``):

    act = silu_mul_ref(gate_up)
    sum_{p < P} y[p, 0, t, r] == lora_shrink_ref(act, A, token_slots, ranks)[0, t, r]

The shrink programs come first in the grid, so they take the SMs first; the row programs are short. Each shrink
program reads gate and up for its tokens and K part: twice the bytes of reading act, and the same bytes the row
programs read anyway (from L2 where the step is small).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels.fused_ops import silu_mul_block
from loraplex.kernels.host_math import cdiv, next_power_of_2
from loraplex.kernels.launch import fast_launch
from loraplex.kernels.lora_meta import LoRAKernelMeta
from loraplex.kernels.lora_shrink import (
    UNSPECIALIZED,
    X_SILU_MUL,
    chunk_tables,
    dot_precision,
    num_chunks_of,
    shrink_program,
)


@fast_launch
@triton.jit(do_not_specialize=UNSPECIALIZED + ("shrink_total",))
def _silu_mul_shrink_kernel(
    gu_ptr, act_ptr, a_ptr, y_ptr, ranks_ptr,
    sorted_ids_ptr, chunk_slots_ptr, chunk_starts_ptr, chunk_lens_ptr, num_chunks_ptr,
    chunk_tokens_ptr, chunk_ranks_ptr,
    K, progs, r_tiles, shrink_total,
    stride_gu, stride_act,
    stride_al, stride_as, stride_ar, stride_ak,
    stride_yp, stride_ys, stride_yt, stride_yr,
    stride_rs, stride_crs,
    SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, CHUNK_TABLES: tl.constexpr, ROW_BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid < shrink_total:
        rest = pid // progs
        shrink_program(pid % progs, rest % r_tiles, rest // r_tiles, gu_ptr, a_ptr, y_ptr, ranks_ptr,
                       sorted_ids_ptr, chunk_slots_ptr, chunk_starts_ptr, chunk_lens_ptr, num_chunks_ptr,
                       chunk_tokens_ptr, chunk_ranks_ptr, y_ptr,
                       K, progs, 1,
                       stride_gu, 1, stride_al, stride_as, stride_ar, stride_ak,
                       stride_yp, stride_ys, stride_yt, stride_yr, stride_rs, stride_crs,
                       SPLIT_K=SPLIT_K, BLOCK_M=BLOCK_M, BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K, DOT_PRECISION=DOT_PRECISION,
                       USE_PDL=False, CHUNK_TABLES=CHUNK_TABLES, PREFETCH_A=0, PF_LINE=64, SIGNAL=False,
                       X_MODE=X_SILU_MUL)
    else:
        q = pid - shrink_total
        col_blocks = tl.cdiv(K, ROW_BLOCK)
        silu_mul_block(gu_ptr, act_ptr, (q // col_blocks).to(tl.int64), q % col_blocks, stride_gu, stride_act, K,
                       ROW_BLOCK)


def silu_mul_shrink(
    gate_up: torch.Tensor,  # [T, 2I], gate first
    lora_a: torch.Tensor,  # [num_slots, 1, R, I]: the down projection's A
    ranks: torch.Tensor,  # [1, num_slots] int32
    meta: LoRAKernelMeta,
    *,
    split_k: int = 1,
    progs: int | None = None,
    block_r: int = 16,
    block_k: int = 128,
    y: torch.Tensor | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
    chunk_ranks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(act [T, I], y [split_k, 1, T, R] float32 partials) in one launch: ``fused_ops.silu_mul(gate_up)`` and
    ``lora_shrink(act, lora_a, ...)`` with the same arguments (module doc); the expand reads y as after
    ``lora_shrink``."""
    assert gate_up.dim() == 2 and gate_up.stride(-1) == 1 and gate_up.shape[1] % 2 == 0
    num_tokens, k_dim = gate_up.shape[0], gate_up.shape[1] // 2
    num_slots, num_slices, max_rank, a_k = lora_a.shape
    assert num_slices == 1, f"the down projection has one slice, lora_a has {num_slices}"
    assert a_k == k_dim, f"gate|up gives K={k_dim}, lora_a has K={a_k}"
    assert gate_up.dtype == lora_a.dtype, f"gate_up is {gate_up.dtype}, lora_a is {lora_a.dtype}"
    assert lora_a.stride(3) == 1
    assert ranks.shape == (num_slices, num_slots) and ranks.dtype == torch.int32 and ranks.stride(1) == 1
    assert meta.num_tokens == num_tokens and meta.num_slots == num_slots
    assert meta.block_m >= 16 and block_r >= 16 and block_k >= 16, "tl.dot needs tiles of at least 16"
    act = torch.empty(num_tokens, k_dim, dtype=gate_up.dtype, device=gate_up.device)
    if y is None:
        y = torch.empty(split_k, num_slices, num_tokens, max_rank, dtype=torch.float32, device=gate_up.device)
    y = y[:split_k, :num_slices]
    assert y.shape[2:] == (num_tokens, max_rank) and y.dtype == torch.float32
    if num_tokens == 0:
        return act, y
    progs = split_k * meta.max_chunks if progs is None else progs
    r_tiles = cdiv(max_rank, block_r)
    shrink_total = progs * r_tiles * num_slices if meta.max_chunks else 0
    row_block = min(next_power_of_2(k_dim), 512 * num_warps)
    grid = (shrink_total + num_tokens * cdiv(k_dim, row_block),)
    tables = chunk_tables(meta, chunk_ranks, num_slices)
    _silu_mul_shrink_kernel[grid](
        gate_up, act, lora_a, y, ranks,
        meta.sorted_token_ids, meta.chunk_slots, meta.chunk_starts, meta.chunk_lens, num_chunks_of(meta),
        *tables,
        k_dim, max(progs, 1), r_tiles, shrink_total,
        gate_up.stride(0), act.stride(0),
        lora_a.stride(0), lora_a.stride(1), lora_a.stride(2), lora_a.stride(3),
        y.stride(0), y.stride(1), y.stride(2), y.stride(3),
        ranks.stride(0), tables[1].stride(0),
        SPLIT_K=split_k, BLOCK_M=meta.block_m, BLOCK_R=block_r, BLOCK_K=block_k,
        DOT_PRECISION=dot_precision(gate_up.dtype), CHUNK_TABLES=tables[0] is not meta.chunk_slots,
        ROW_BLOCK=row_block, num_warps=num_warps, num_stages=num_stages,
    )
    return act, y
