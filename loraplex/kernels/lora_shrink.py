"""LoRA shrink in Triton: y = x @ A for a batch whose tokens carry their own adapter slot.

Semantics (twin: ``lora_ref.lora_shrink_ref``), for token t with slot l = token_slots[t] >= 0, slice s,
r < rank[s, l], split p:

    y[p, s, t, r] = sum_{k in split p} x[t, k] * A[l, s, r, k]      (float32 accumulate)
    sum_p y[p, s, t, r] == lora_shrink_ref(...)[s, t, r]

Entries of y for slot -1 tokens or r >= rank are NOT written (the expand masks them by rank).

Shape:
    x        [T, K]                  model dtype
    lora_a   [num_slots, S, R, K]    model dtype, rank rows packed first
    ranks    [S, num_slots] int32
    y        [SPLIT_K, S, T, R] float32 scratch

Grid: (SPLIT_K * cdiv(R, BLOCK_R), max_chunks, S). A program owns one chunk of <= BLOCK_M tokens of one
slot, one rank tile and one K range; it exits at once when the chunk is unused, or its rank tile lies
beyond the slot's real rank (so padding up to R is never read). Split-K partials are reduced by the
expand kernel (two-pass, atomic-free: works under TRITON_INTERPRET=1 and needs no zeroing).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels.lora_meta import LoRAKernelMeta


@triton.jit
def _lora_shrink_kernel(
    x_ptr, a_ptr, y_ptr, ranks_ptr,
    sorted_ids_ptr, chunk_slots_ptr, chunk_starts_ptr, chunk_lens_ptr,
    K, k_per_split,
    stride_xt, stride_xk,
    stride_al, stride_as, stride_ar, stride_ak,
    stride_yp, stride_ys, stride_yt, stride_yr,
    stride_rs,
    SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid0 = tl.program_id(0)
    chunk = tl.program_id(1)
    sl = tl.program_id(2)
    split = pid0 % SPLIT_K
    r_tile = pid0 // SPLIT_K
    slot = tl.load(chunk_slots_ptr + chunk)
    if slot < 0:
        return
    rank = tl.load(ranks_ptr + sl * stride_rs + slot)
    r0 = r_tile * BLOCK_R
    if r0 >= rank:
        return
    start = tl.load(chunk_starts_ptr + chunk)
    length = tl.load(chunk_lens_ptr + chunk)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < length
    tok = tl.load(sorted_ids_ptr + start + offs_m, mask=m_mask, other=0).to(tl.int64)
    offs_r = r0 + tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    offs_k = tl.arange(0, BLOCK_K)
    k_begin = split * k_per_split
    x_ptrs = x_ptr + tok[:, None] * stride_xt + (k_begin + offs_k)[None, :].to(tl.int64) * stride_xk
    a_base = a_ptr + slot.to(tl.int64) * stride_al + sl.to(tl.int64) * stride_as
    a_ptrs = a_base + offs_r[None, :].to(tl.int64) * stride_ar + (k_begin + offs_k)[:, None].to(tl.int64) * stride_ak
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for kk in range(0, k_per_split, BLOCK_K):
        k_mask = (k_begin + kk + offs_k) < K
        xt = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        at = tl.load(a_ptrs, mask=k_mask[:, None] & r_mask[None, :], other=0.0)
        acc += tl.dot(xt, at, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        a_ptrs += BLOCK_K * stride_ak
    y_ptrs = (y_ptr + split * stride_yp + sl * stride_ys + tok[:, None] * stride_yt
              + offs_r[None, :] * stride_yr)
    tl.store(y_ptrs, acc, mask=m_mask[:, None] & r_mask[None, :])


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 models (tests, CPU parity) want exact fp32 products, not tf32
    return "ieee" if dtype == torch.float32 else "tf32"


def lora_shrink(
    x: torch.Tensor,  # [T, K]
    lora_a: torch.Tensor,  # [num_slots, S, R, K]
    ranks: torch.Tensor,  # [S, num_slots] int32
    meta: LoRAKernelMeta,
    *,
    split_k: int = 1,
    block_r: int = 16,
    block_k: int = 128,
    y: torch.Tensor | None = None,  # [>=split_k, >=S, T, R] float32 scratch, reused across layers
    num_warps: int = 4,
    num_stages: int = 3,
) -> torch.Tensor:  # [split_k, S, T, R] float32 partial sums
    num_tokens, k_dim = x.shape
    num_slots, num_slices, max_rank, a_k = lora_a.shape
    assert a_k == k_dim, f"x has K={k_dim}, lora_a has K={a_k}"
    assert x.dtype == lora_a.dtype, f"x is {x.dtype}, lora_a is {lora_a.dtype}"
    assert lora_a.stride(3) == 1 and x.stride(1) == 1, "x and lora_a must be contiguous along K"
    assert ranks.shape == (num_slices, num_slots) and ranks.dtype == torch.int32 and ranks.stride(1) == 1
    assert meta.num_tokens == num_tokens and meta.num_slots == num_slots
    assert meta.block_m >= 16 and block_r >= 16 and block_k >= 16, "tl.dot needs tiles of at least 16"
    if y is None:
        y = torch.empty(split_k, num_slices, num_tokens, max_rank, dtype=torch.float32, device=x.device)
    y = y[:split_k, :num_slices]
    assert y.shape[2:] == (num_tokens, max_rank) and y.dtype == torch.float32
    if num_tokens == 0 or meta.max_chunks == 0:
        return y
    k_per_split = triton.cdiv(triton.cdiv(k_dim, split_k), block_k) * block_k
    grid = (split_k * triton.cdiv(max_rank, block_r), meta.max_chunks, num_slices)
    _lora_shrink_kernel[grid](
        x, lora_a, y, ranks,
        meta.sorted_token_ids, meta.chunk_slots, meta.chunk_starts, meta.chunk_lens,
        k_dim, k_per_split,
        x.stride(0), x.stride(1),
        lora_a.stride(0), lora_a.stride(1), lora_a.stride(2), lora_a.stride(3),
        y.stride(0), y.stride(1), y.stride(2), y.stride(3),
        ranks.stride(0),
        SPLIT_K=split_k, BLOCK_M=meta.block_m, BLOCK_R=block_r, BLOCK_K=block_k,
        DOT_PRECISION=dot_precision(x.dtype), num_warps=num_warps, num_stages=num_stages,
    )
    return y
