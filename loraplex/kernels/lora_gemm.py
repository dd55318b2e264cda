"""A decode step's projection with its LoRA delta in one Triton GEMM: the expand folded into the base GEMM.

Semantics (twin: ``lora_gemm_ref``), for row m with slot l = token_slots[m] >= 0, column n of slice s
(slice_loc[s] <= n < slice_loc[s + 1]), r = rank[s, l]::

    y_m[j]    = sum_{p < P} y[p, s, m, j]                                   (the shrink's split-K partials, j < r)
    out[m, n] = cast(sum_k x[m, k] * W[n, k] + bias[n] + scaling[l] * sum_{j < r} bf(y_m[j]) * B[l, j, n])

(fp32 accumulation; ``bf`` = y rounded to the weights' dtype before its product, as in ``lora_expand``.) Rows of slot
-1 tokens and slices an adapter does not target get the base projection alone.

Why: in a decode step the usual order is the base GEMM (cuBLAS), then the shrink, then the expand, which reads every
row's adapter B and reads and rewrites the GEMM's output. Each of those launches moves a few MB and pays a fixed few
microseconds; 8 LoRA launches per layer were about half of the LoRA cost of a 64-adapter step on the H200
(docs/benchmarks/NOTES-lora.md). Here the shrink runs first (``lora_shrink``, unchanged) and this kernel computes the
base projection and adds every row's delta in its epilogue while the tile is still in registers: one launch fewer per
projection, no read-modify-write of the output, and B is gathered per row (row m reads B[slot_m, :, its columns]).

Each program owns BLOCK_M rows x BLOCK_N columns and loops over K (x and W tiles, ``tl.dot``); BLOCK_N divides every
slice width (the caller checks), so a tile lies in one slice. The epilogue loops over rank rows j up to the largest
rank among its rows: it sums y's valid partials for its rows (whole rows of y per partial) and adds y_m[j] * B[slot_m, j, tile]
([BLOCK_M, BLOCK_N] gather). Programs along axis 0 share a column tile (several row tiles read the same W from L2).

Programmatic dependent launch (``pdl``): the launch may start while the shrink before it runs; every program waits
(griddepcontrol.wait) before reading anything an earlier launch wrote (x, y). With ``overlap`` (the shrink launched
with ``late_trigger``: this launch starts only after the launch that wrote x has completed) the main loop runs
first, alongside the shrink, and the wait comes before the epilogue reads y: both stream their weights at once.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from loraplex.kernels.host_math import cdiv, next_power_of_2
from loraplex.kernels.launch import fast_launch
from loraplex.kernels.lora_shrink import dot_precision, gdc_wait, split_parts

UNSPECIALIZED = ("M", "shrink_progs", "k_tiles", "stride_xm", "stride_om", "stride_yp", "stride_ys")


@fast_launch
@triton.jit(do_not_specialize=UNSPECIALIZED)
def _gemm_lora_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr,
    y_ptr, b_ptr, slots_ptr, ranks_ptr, scaling_ptr, slice_loc_ptr, num_chunks_ptr,
    M, N, K, shrink_progs, k_tiles,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_on,
    stride_yp, stride_ys, stride_yt, stride_yr,
    stride_bl, stride_br, stride_bn, stride_rs,
    NUM_SLICES: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr = False,
    EARLY_MAIN: tl.constexpr = False,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if USE_PDL:
        if not EARLY_MAIN:
            gdc_wait()  # x and y are written by earlier launches
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # BLOCK_N divides N
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :] * stride_xk
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk  # [BK, BN]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            xt = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
            wt = tl.load(w_ptrs)
        else:
            k_mask = (k0 + offs_k) < K
            xt = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            wt = tl.load(w_ptrs, mask=k_mask[:, None], other=0.0)
        acc += tl.dot(xt, wt, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n).to(tl.float32)[None, :]
    if USE_PDL:
        if EARLY_MAIN:
            gdc_wait()  # the shrink (y) has completed
    if HAS_LORA:
        # the tile's slice (a tile never straddles two: BLOCK_N divides every slice width)
        n0 = pid_n * BLOCK_N
        sl = 0
        for s in tl.static_range(1, NUM_SLICES):
            sl += (n0 >= tl.load(slice_loc_ptr + s)).to(tl.int32)
        slot = tl.load(slots_ptr + offs_m, mask=m_mask, other=-1)
        has = slot >= 0
        slot_c = tl.maximum(slot, 0).to(tl.int64)
        rank = tl.load(ranks_ptr + sl * stride_rs + slot_c, mask=has, other=0)
        scale = tl.load(scaling_ptr + slot_c, mask=has, other=0.0)
        parts, _ = split_parts(shrink_progs, tl.load(num_chunks_ptr), SPLIT_K, k_tiles)
        # the rows' y: the shrink's valid partials summed, each a [BLOCK_M, BLOCK_R] load of whole rows (64 bytes at
        # rank 16), then rounded as the expand rounds it
        offs_r = tl.arange(0, BLOCK_R)
        y_ptrs = (y_ptr + sl * stride_ys + offs_m[:, None].to(tl.int64) * stride_yt
                  + offs_r[None, :] * stride_yr)
        y_mask = has[:, None] & (offs_r[None, :] < rank[:, None])
        ys = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for p in range(0, parts):
            ys += tl.load(y_ptrs + p * stride_yp, mask=y_mask, other=0.0)
        ys = ys.to(b_ptr.dtype.element_ty).to(tl.float32)
        # delta[m, :] = sum_j y_m[j] * B[slot_m, j, tile]: one [BLOCK_M, BLOCK_N] gather of B rows per rank row j
        b_ptrs = b_ptr + slot_c[:, None] * stride_bl + offs_n[None, :].to(tl.int64) * stride_bn
        delta = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for j in range(0, tl.max(rank, axis=0)):
            y_j = tl.sum(tl.where(offs_r[None, :] == j, ys, 0.0), axis=1)  # column j of ys
            b_j = tl.load(b_ptrs + j * stride_br, mask=(has & (j < rank))[:, None], other=0.0)
            delta += y_j[:, None] * b_j.to(tl.float32)
        acc += delta * scale[:, None]
    o_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :] * stride_on
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None])


# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) per projection shape and step size, from an H200 sweep
# (``python -m loraplex.bench.lora_gemm``); keyed by (N, K, rows) with rows "small" (<= 64) or "large"
TUNED_BLOCKS: dict[tuple[int, int, str], tuple[int, int, int, int, int]] = {}


# with PDL, the GEMM's main loop alongside the shrink (see the module doc); LORAPLEX_LORA_GEMM_OVERLAP=0: after it
OVERLAP_SHRINK = os.environ.get("LORAPLEX_LORA_GEMM_OVERLAP", "1") != "0"


def rows_bucket(m: int) -> str:
    return "small" if m <= 64 else "large"

# aim for about this many programs (2 per SM on an H200): each streams a column strip of W over all of K
TARGET_PROGRAMS = 264


def choose_gemm_blocks(m: int, n: int, k: int, slice_widths=()) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) from host sizes: row tiles of up to 64 rows (padded to 16),
    the widest column tile (128 down to 16) dividing N and every slice width that still gives about TARGET_PROGRAMS
    programs, and deeper K tiles for narrow column tiles (bytes per pipeline stage)."""
    bm = min(64, max(16, next_power_of_2(m)))
    tuned = TUNED_BLOCKS.get((n, k, rows_bucket(m)))
    if tuned is not None and n % tuned[1] == 0 and all(w % tuned[1] == 0 for w in slice_widths):
        return (min(bm, tuned[0]) if m <= 64 else tuned[0], *tuned[1:])
    widths = tuple(slice_widths) or (n,)
    fits = [bn for bn in (128, 64, 32, 16) if n % bn == 0 and all(w % bn == 0 for w in widths)]
    if not fits:
        return bm, 0, 0, 0, 0
    bn = next((b for b in fits if cdiv(m, bm) * (n // b) >= TARGET_PROGRAMS), fits[-1])
    bk = 128 if bn >= 64 else 256
    return bm, bn, bk, 4, 4


def gemm_lora_supported(n: int, slice_widths, blocks=None) -> bool:
    """Whether some column tile divides N and every slice width (a tile must lie in one slice)."""
    bn = (blocks or choose_gemm_blocks(16, n, 0, slice_widths))[1]
    return bn > 0 and n % bn == 0 and all(w % bn == 0 for w in slice_widths)


def gemm_lora(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None,  # [N] or None
    y: torch.Tensor | None,  # [>= split_k, S, M, R] float32 shrink partials (None: the base projection alone)
    lora_b: torch.Tensor | None = None,  # [num_slots, R, N]
    token_slots: torch.Tensor | None = None,  # [M] int32, -1 = base
    ranks: torch.Tensor | None = None,  # [S, num_slots] int32
    scaling: torch.Tensor | None = None,  # [num_slots] float32
    slice_loc: torch.Tensor | None = None,  # [S + 1] int32 (device)
    num_chunks: torch.Tensor | None = None,  # [1] int32 (device): the shrink's chunks in use
    *,
    split_k: int = 1,  # the shrink's most parts per chunk (its y rows)
    shrink_progs: int = 1,
    k_tiles: int = 1,
    slice_widths=(),  # host copy of the slice widths (checked against the column tile)
    blocks: tuple[int, ...] | None = None,
    pdl: bool = False,
    overlap: bool = False,  # with pdl: the main loop before the wait (the shrink was launched with late_trigger)
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` plus every row's LoRA delta from the shrink's partials ``y``; see the module doc.
    The partials are those ``lora_shrink`` wrote with ``split_k`` parts over ``shrink_progs`` programs and ``k_tiles``
    K tiles (``lora_ops.lora_shrink_apply`` returns them)."""
    m, k = x.shape
    n, wk = weight.shape
    assert wk == k, f"x has K={k}, the weight has K={wk}"
    assert x.dtype == weight.dtype and x.stride(1) == 1 and weight.stride(1) == 1
    has_lora = y is not None
    num_slices = 1
    if has_lora:
        num_slices = ranks.shape[0]
        assert lora_b.shape[2] == n and lora_b.dtype == x.dtype and lora_b.stride(2) == 1
        assert slice_loc.shape == (num_slices + 1,) and token_slots.shape == (m,) and token_slots.dtype == torch.int32
        assert ranks.dtype == torch.int32 and ranks.stride(1) == 1 and scaling.dtype == torch.float32
        assert y.dtype == torch.float32 and y.shape[0] >= split_k and y.shape[2] == m
    widths = tuple(slice_widths) or (n,)
    bm, bn, bk, warps, stages = tuple(blocks or choose_gemm_blocks(m, n, k, widths))
    assert bn > 0 and n % bn == 0 and all(w % bn == 0 for w in widths), f"no column tile fits N={n}, slices {widths}"
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    dummy = out
    _gemm_lora_kernel[(cdiv(m, bm), n // bn)](
        x, weight, bias if bias is not None else dummy, out,
        y if has_lora else dummy, lora_b if has_lora else dummy, token_slots if has_lora else dummy,
        ranks if has_lora else dummy, scaling if has_lora else dummy, slice_loc if has_lora else dummy,
        num_chunks if has_lora else dummy,
        m, n, k, shrink_progs, k_tiles,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), out.stride(0), out.stride(1),
        *(y.stride() if has_lora else (0, 0, 0, 0)),
        *(lora_b.stride() if has_lora else (0, 0, 0)), ranks.stride(0) if has_lora else 0,
        NUM_SLICES=num_slices, SPLIT_K=split_k, BLOCK_R=next_power_of_2(max(16, y.shape[3] if has_lora else 16)),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=k % bk == 0, HAS_BIAS=bias is not None, HAS_LORA=has_lora,
        DOT_PRECISION=dot_precision(x.dtype), USE_PDL=pdl, EARLY_MAIN=overlap and pdl, num_warps=warps,
        num_stages=stages,
        **({"launch_pdl": True} if pdl else {}),
    )
    return out


def lora_gemm_ref(x, weight, bias, y_sum, lora_b, token_slots, ranks, scaling, slice_loc_host) -> torch.Tensor:
    """The twin: fp32 base projection plus each row's delta from the summed shrink ``y_sum`` [S, M, R] (rounded to the
    weights' dtype, as the kernel rounds it), one rounding at the end."""
    acc = x.float() @ weight.float().t()
    if bias is not None:
        acc = acc + bias.float()
    for s in range(ranks.shape[0]):
        lo, hi = slice_loc_host[s], slice_loc_host[s + 1]
        for m in range(x.shape[0]):
            slot = int(token_slots[m])
            if slot < 0:
                continue
            r = int(ranks[s, slot])
            if r == 0:
                continue
            yv = y_sum[s, m, :r].to(lora_b.dtype).float()
            acc[m, lo:hi] += float(scaling[slot]) * (yv @ lora_b[slot, :r, lo:hi].float())
    return acc.to(x.dtype)
