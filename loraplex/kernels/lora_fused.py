"""Fused LoRA for decode steps: shrink and expand of one fused projection in ONE launch.

Semantics (twin: ``lora_ref.lora_apply_ref``), for token t with slot l = token_slots[t] >= 0, slice s with
r = rank[s, l] > 0, column n of slice s:

    y_t[j]    = sum_k x[t, k] * A[l, s, j, k]                     (float32, j < r)
    out[t, n] = cast(float32(out[t, n]) + scaling[l] * sum_{j<r} bf(y_t[j]) * B[l, j, n])

(``bf`` = rounded to the weights' dtype before the product, as in the two-launch expand.)

Why: a decode step has about one token per adapter, so each kernel moves a few MB and a two-launch
shrink/expand pair pays two launch gaps and two ramp-up/tails per projection (256 per Llama-3-8B step).
One launch per projection halves that. The expand needs the whole K reduction of the shrink, so a
program either

- ``split_k == 1``: owns (chunk, slice, a run of ``max_slice_width / n_splits`` columns), computes the full y of its
  chunk itself, then adds its columns. The ``n_splits`` programs of one (chunk, slice) re-read the same
  A rows; they have consecutive program ids, run together and mostly hit L2. Atomic-free.
- ``split_k > 1``: owns (chunk, slice, 1/split_k of K): it writes its partial y to the fp32 scratch,
  then takes a ticket from a per-(chunk, slice) counter (acq_rel, GPU scope, after a CTA barrier, the
  CUTLASS semaphore pattern); the last-arriving program sums the partials and adds the whole slice's
  columns, then resets the counter to 0 for the next launch (stream order makes that reset visible).
  Every program of a (chunk, slice) takes a ticket or none (slot and rank are per chunk and slice), so
  counters always return to 0.

Shape:
    x         [T, K]                      model dtype
    lora_a    [num_slots, S, R, K]        rank rows packed first
    lora_b    [num_slots, R, N_total]
    ranks     [S, num_slots] int32
    scaling   [num_slots] float32
    slice_loc [S + 1] int32
    out       [T, N_total]                updated in place; slot -1 rows and rank-0 slices never written
    y         [split_k, S, T, R] float32  scratch (split_k > 1 only)
    counters  [max_chunks * S] int32      zero before the first launch; zero again after each launch

Grid: (split_k, or cdiv(max_slice_width, columns per program), max_chunks, S); split_k == 1 or n_splits == 1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels.host_math import cdiv, next_power_of_2
from loraplex.kernels.launch import fast_launch
from loraplex.kernels.lora_meta import LoRAKernelMeta, check_apply_args
from loraplex.kernels.lora_shrink import dot_precision


@fast_launch
@triton.jit(do_not_specialize=["per_split"])
def _lora_fused_kernel(
    x_ptr, a_ptr, b_ptr, out_ptr, y_ptr, cnt_ptr, ranks_ptr, scaling_ptr, slice_loc_ptr,
    sorted_ids_ptr, chunk_slots_ptr, chunk_starts_ptr, chunk_lens_ptr,
    K, k_per_split, per_split,
    stride_xt, stride_xk,
    stride_al, stride_as, stride_ar, stride_ak,
    stride_bl, stride_br, stride_bn,
    stride_ot, stride_on,
    stride_yp, stride_ys, stride_yt, stride_yr,
    stride_rs,
    SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, COL_ALIGN: tl.constexpr = 1,
):
    pid0 = tl.program_id(0)
    chunk = tl.program_id(1)
    sl = tl.program_id(2)
    num_slices = tl.num_programs(2)
    slot = tl.load(chunk_slots_ptr + chunk)
    if slot < 0:
        return
    rank = tl.load(ranks_ptr + sl * stride_rs + slot)
    if rank == 0:
        return
    n_begin = tl.load(slice_loc_ptr + sl)
    n_end = tl.load(slice_loc_ptr + sl + 1)
    if COL_ALIGN > 1:  # as in lora_expand: 16-byte, pipelined B / out accesses (the caller guarantees it)
        n_begin = tl.multiple_of(n_begin, COL_ALIGN)
        n_end = tl.multiple_of(n_end, COL_ALIGN)
    if SPLIT_K == 1:
        # this program's columns: per_split of them (whole BLOCK_N tiles, the same for every slice, so a
        # narrow GQA k or v slice gets fewer programs than q and every program moves about the same bytes)
        n_lo = n_begin + pid0 * per_split
        if n_lo >= n_end:
            return
        n_hi = tl.minimum(n_lo + per_split, n_end)
        k_begin = 0
    else:
        n_lo = n_begin
        n_hi = n_end
        k_begin = pid0 * k_per_split
    start = tl.load(chunk_starts_ptr + chunk)
    length = tl.load(chunk_lens_ptr + chunk)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < length
    tok = tl.load(sorted_ids_ptr + start + offs_m, mask=m_mask, other=0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank  # rows past the real rank are never read
    offs_k = tl.arange(0, BLOCK_K)

    # shrink over this program's K range
    if SPLIT_K == 1:
        k_offs = offs_k  # (no python-int + tensor: the AOT compile test runs beside the interpreter)
        k_end = K
    else:
        k_offs = k_begin + offs_k
        k_end = tl.minimum(k_begin + k_per_split, K)
    x_ptrs = x_ptr + tok[:, None] * stride_xt + k_offs[None, :].to(tl.int64) * stride_xk
    a_base = a_ptr + slot.to(tl.int64) * stride_al + sl.to(tl.int64) * stride_as
    a_ptrs = a_base + offs_r[None, :].to(tl.int64) * stride_ar + k_offs[:, None].to(tl.int64) * stride_ak
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for kk in range(k_begin, k_end, BLOCK_K):
        k_mask = (kk + offs_k) < k_end
        xt = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        at = tl.load(a_ptrs, mask=k_mask[:, None] & r_mask[None, :], other=0.0)
        acc += tl.dot(xt, at, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        a_ptrs += BLOCK_K * stride_ak

    if SPLIT_K > 1:
        y_ptrs = y_ptr + sl * stride_ys + tok[:, None] * stride_yt + offs_r[None, :] * stride_yr
        y_mask = m_mask[:, None] & r_mask[None, :]
        tl.store(y_ptrs + pid0 * stride_yp, acc, mask=y_mask)
        tl.debug_barrier()  # every thread's partial is stored before the ticket is released
        ticket = tl.atomic_add(cnt_ptr + chunk * num_slices + sl, 1, sem="acq_rel", scope="gpu")
        tl.debug_barrier()
        if ticket != SPLIT_K - 1:
            return
        tl.store(cnt_ptr + chunk * num_slices + sl, 0)  # ready for the next launch
        # all partials, this program's own included (same threads stored them); .cg reads L2, never a
        # stale L1 line, as the others were written by other SMs
        acc = tl.load(y_ptrs, mask=y_mask, other=0.0, cache_modifier=".cg")
        for q in tl.static_range(1, SPLIT_K):
            acc += tl.load(y_ptrs + q * stride_yp, mask=y_mask, other=0.0, cache_modifier=".cg")

    # expand: out[:, n_lo:n_hi] += scale * y @ B
    scale = tl.load(scaling_ptr + slot)
    b_rows = b_ptr + slot.to(tl.int64) * stride_bl + offs_r[:, None].to(tl.int64) * stride_br
    o_rows = out_ptr + tok[:, None] * stride_ot
    for n0 in range(n_lo, n_hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < n_hi
        b = tl.load(b_rows + offs_n[None, :].to(tl.int64) * stride_bn, mask=r_mask[:, None] & n_mask[None, :],
                    other=0.0)
        delta = tl.dot(acc.to(b.dtype), b, input_precision=DOT_PRECISION) * scale
        o_ptrs = o_rows + offs_n[None, :].to(tl.int64) * stride_on
        o_mask = m_mask[:, None] & n_mask[None, :]
        base = tl.load(o_ptrs, mask=o_mask, other=0.0)
        tl.store(o_ptrs, (base.to(tl.float32) + delta).to(base.dtype), mask=o_mask)


def fused_block_r(max_rank: int) -> int:
    return max(16, next_power_of_2(max_rank))


def lora_fused(
    x: torch.Tensor,  # [T, K]
    out: torch.Tensor,  # [T, N_total], updated in place
    lora_a: torch.Tensor,  # [num_slots, S, R, K]
    lora_b: torch.Tensor,  # [num_slots, R, N_total]
    ranks: torch.Tensor,  # [S, num_slots] int32
    scaling: torch.Tensor,  # [num_slots] float32
    slice_loc: torch.Tensor,  # [S + 1] int32 (device)
    max_slice_width: int,
    meta: LoRAKernelMeta,
    *,
    split_k: int = 1,
    n_splits: int = 1,
    block_k: int = 128,
    block_n: int = 128,
    y: torch.Tensor | None = None,  # [>=split_k, >=S, T, R] float32 (split_k > 1)
    counters: torch.Tensor | None = None,  # [>= max_chunks * S] int32, zeros (split_k > 1)
    num_warps: int = 4,
    num_stages: int = 3,
    col_align: int = 1,  # lora_expand.slice_col_align of the slice offsets
) -> torch.Tensor:
    """Semantics: ``lora_ref.lora_apply_ref``, in one launch."""
    num_tokens, k_dim, num_slices, max_rank = check_apply_args(x, out, lora_a, lora_b, ranks, scaling, slice_loc, meta)
    assert meta.block_m >= 16 and block_k >= 16 and block_n >= 16, "tl.dot needs tiles of at least 16"
    assert split_k == 1 or n_splits == 1, "either split K (last arriver expands) or split N, not both"
    assert col_align in (1, 2, 4, 8, 16) and col_align <= block_n
    if num_tokens == 0 or meta.max_chunks == 0:
        return out
    if split_k > 1:
        if y is None:
            y = torch.empty(split_k, num_slices, num_tokens, max_rank, dtype=torch.float32, device=x.device)
        y = y[:split_k, :num_slices]
        assert y.shape[2:] == (num_tokens, max_rank) and y.dtype == torch.float32
        if counters is None:
            counters = torch.zeros(meta.max_chunks * num_slices, dtype=torch.int32, device=x.device)
        assert counters.dtype == torch.int32 and counters.numel() >= meta.max_chunks * num_slices
        k_per_split = cdiv(cdiv(k_dim, split_k), block_k) * block_k
        y_strides = y.stride()
        parts, per_split = split_k, 0
    else:
        y = counters = x  # unused by the atomic-free variant
        k_per_split = k_dim
        y_strides = (0, 0, 0, 0)
        # n_splits programs over the widest slice; narrower slices use the first few of them
        per_split = cdiv(cdiv(max_slice_width, max(1, n_splits)), block_n) * block_n
        parts = cdiv(max_slice_width, per_split)
    grid = (parts, meta.max_chunks, num_slices)
    _lora_fused_kernel[grid](
        x, lora_a, lora_b, out, y, counters, ranks, scaling, slice_loc,
        meta.sorted_token_ids, meta.chunk_slots, meta.chunk_starts, meta.chunk_lens,
        k_dim, k_per_split, per_split,
        x.stride(0), x.stride(1),
        lora_a.stride(0), lora_a.stride(1), lora_a.stride(2), lora_a.stride(3),
        lora_b.stride(0), lora_b.stride(1), lora_b.stride(2),
        out.stride(0), out.stride(1),
        *y_strides,
        ranks.stride(0),
        SPLIT_K=split_k, BLOCK_M=meta.block_m, BLOCK_R=fused_block_r(max_rank), BLOCK_K=block_k, BLOCK_N=block_n,
        DOT_PRECISION=dot_precision(x.dtype), COL_ALIGN=col_align, num_warps=num_warps, num_stages=num_stages,
    )
    return out
