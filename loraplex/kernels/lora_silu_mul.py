"""The gate|up LoRA expand folded into SiLU-and-multiply: ``act = silu(gate + dg) * (up + du)`` in one kernel.

The expand of ``lora_expand`` reads and writes the whole projection output (``out += y B``); for gate|up that
is 2 x 28,672 bf16 columns per token of an 8B model, about two thirds of a prompt step's LoRA memory traffic
(the FLOPs of rank 16 are ~1% of the base GEMM's). SiLU-and-multiply reads that output anyway, so here it adds
the low-rank delta itself while it reads gate and up, and the output is never written back.

Semantics (twin: ``lora_silu_mul_ref``), token t with slot l = token_slots[t], I = gate width:

    g = cast(float32(gate_up[t, n]) + scaling[l] * sum_{j < r_g} y_t[0, j] * B[l, j, n])        (0 <= n < I)
    u = cast(float32(gate_up[t, I + n]) + scaling[l] * sum_{j < r_u} y_t[1, j] * B[l, j, I + n])
    act[t, n] = cast(float32(cast(silu(float32(g)))) * float32(u))

with ``y_t[s, j] = sum_p y[p, s, t, j]`` (the shrink's split-K partials), r_g, r_u the slot's ranks of gate and
up; tokens with slot -1 (and slices of rank 0) get no delta. ``cast`` rounds to gate_up's dtype, so the result
is the unfused path's (expand into gate_up, then ``silu_mul``) up to the dot's summation order.

Launch options (``lora_ops.lora_silu_mul_apply`` passes the expand's): ``n_splits`` column splits per chunk, the tile,
warps and stages; programmatic dependent launch after the shrink (metadata read first, then a wait before y and
gate_up; program 0 always waits); per-chunk tables (slot, both ranks and tokens in one round trip); gate and up tiles
loaded one trip ahead. Before run 28 the engine launched it with none of these: one program per column tile of every
chunk (30,464 programs for a 256-row step). With these options it is still slower than the expand + ``silu_mul`` in
decode steps of more than one adapter (H100, run 28: gate|up + SiLU over 32 layers +0.13-1.2 ms at 256 rows), so the
engine option stays off.

Grid: ``progs`` adapter programs, then base programs. Adapter programs follow the expand: the fixed grid is
spread over the chunks in use (``meta.num_chunks``), each chunk's programs taking whole BLOCK_N tiles of the I
columns, loading y once and, per tile, gate, up and both B tiles. Base programs take blocks of BASE_BLOCK_M
tokens in token order and a share of the columns, and compute rows whose slot is -1 (the others are the adapter
programs'). Every row of act is written exactly once; the grid depends only on T (CUDA-graph safe).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels.host_math import cdiv, next_power_of_2
from loraplex.kernels.launch import fast_launch
from loraplex.kernels.lora_expand import column_share, expand_progs, slice_col_align
from loraplex.kernels.lora_meta import LoRAKernelMeta
from loraplex.kernels.lora_shrink import (
    chunk_rows,
    chunk_tables,
    dot_precision,
    gdc_wait,
    num_chunks_of,
    split_parts,
)

UNSPECIALIZED = ("progs", "shrink_progs", "k_tiles", "num_tokens", "base_splits", "stride_yp", "stride_ys",
                 "stride_crs")


@triton.jit
def _silu_times(g, u, out_dtype: tl.constexpr):
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)  # as silu_mul: float32 inside, rounded once
    return (act.to(tl.float32) * u.to(tl.float32)).to(out_dtype)


@fast_launch
@triton.jit(do_not_specialize=UNSPECIALIZED)
def _lora_silu_mul_kernel(
    gu_ptr, y_ptr, b_ptr, act_ptr, ranks_ptr, scaling_ptr, token_slots_ptr,
    sorted_ids_ptr, chunk_slots_ptr, chunk_starts_ptr, chunk_lens_ptr, num_chunks_ptr,
    chunk_tokens_ptr, chunk_ranks_ptr,
    progs, shrink_progs, k_tiles, num_tokens, width, base_splits,
    stride_gt, stride_yp, stride_ys, stride_yt, stride_yr, stride_bl, stride_br, stride_at, stride_rs, stride_crs,
    SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    BASE_BLOCK_M: tl.constexpr, DOT_PRECISION: tl.constexpr, COL_ALIGN: tl.constexpr = 1,
    USE_PDL: tl.constexpr = False, CHUNK_TABLES: tl.constexpr = False, PREFETCH: tl.constexpr = False,
):
    pid = tl.program_id(0)
    if USE_PDL:
        if pid == 0:
            gdc_wait()  # this launch never completes before its predecessor (the shrink)
    if COL_ALIGN > 1:
        # the caller guarantees that I and the row strides are multiples of COL_ALIGN: every gate, up, B and act
        # access is then 16 bytes wide and B's loop cp.async-pipelined, whether or not the launch specialized I on
        # its divisibility (without either, they are 2-byte scalars). Exact: the product carries the alignment
        width = width // COL_ALIGN * COL_ALIGN
    offs_bn = tl.arange(0, BLOCK_N)
    if pid >= progs:
        # base rows (slot -1): a block of tokens in token order, a share of the columns
        b = pid - progs
        block, n_split = b // base_splits, b % base_splits
        offs_t = block * BASE_BLOCK_M + tl.arange(0, BASE_BLOCK_M)
        t_in = offs_t < num_tokens
        slots = tl.load(token_slots_ptr + offs_t, mask=t_in, other=0)
        rows_mask = t_in & (slots < 0)
        if tl.max(rows_mask.to(tl.int32), axis=0) == 0:
            return  # no base row in this block (the usual case in a step full of adapters)
        share = column_share(width, base_splits, BLOCK_N)
        n_lo = n_split * share
        n_hi = tl.minimum(n_lo + share, width)
        rows = offs_t.to(tl.int64)
        if USE_PDL:
            gdc_wait()  # gate_up is written by an earlier launch
        for n0 in range(n_lo, n_hi, BLOCK_N):
            offs_n = n0 + offs_bn
            mask = rows_mask[:, None] & (offs_n < n_hi)[None, :]
            g = tl.load(gu_ptr + rows[:, None] * stride_gt + offs_n[None, :], mask=mask, other=0.0)
            u = tl.load(gu_ptr + rows[:, None] * stride_gt + (width + offs_n)[None, :], mask=mask, other=0.0)
            tl.store(act_ptr + rows[:, None] * stride_at + offs_n[None, :],
                     _silu_times(g, u, act_ptr.dtype.element_ty), mask=mask)
        return
    num_chunks = tl.load(num_chunks_ptr)
    per_chunk = progs // tl.maximum(num_chunks, 1)
    chunk = pid // per_chunk
    n_split = pid % per_chunk
    if chunk >= num_chunks:
        return
    offs_m = tl.arange(0, BLOCK_M)
    if CHUNK_TABLES:
        # slot, ranks and tokens all indexed by the chunk: one round trip, not a chain of loads
        slot = tl.load(chunk_slots_ptr + chunk)
        rank_g = tl.load(chunk_ranks_ptr + chunk)
        rank_u = tl.load(chunk_ranks_ptr + stride_crs + chunk)
        tok = tl.load(chunk_tokens_ptr + chunk * BLOCK_M + offs_m)
    else:
        slot = tl.load(chunk_slots_ptr + chunk)
        rank_g = tl.load(ranks_ptr + tl.maximum(slot, 0))
        rank_u = tl.load(ranks_ptr + stride_rs + tl.maximum(slot, 0))
        tok = tl.zeros((BLOCK_M,), dtype=tl.int32)
    if slot < 0:
        return
    share = column_share(width, per_chunk, BLOCK_N)
    n_lo = n_split * share
    if n_lo >= width:
        return
    n_hi = tl.minimum(n_lo + share, width)
    tok, m_mask = chunk_rows(tok, chunk, offs_m, sorted_ids_ptr, chunk_starts_ptr, chunk_lens_ptr, CHUNK_TABLES)
    offs_r = tl.arange(0, BLOCK_R)
    rg_mask = offs_r < rank_g
    ru_mask = offs_r < rank_u
    scale = tl.load(scaling_ptr + slot)
    parts, _ = split_parts(shrink_progs, num_chunks, SPLIT_K, k_tiles)
    y_rows = y_ptr + tok[:, None] * stride_yt + offs_r[None, :] * stride_yr
    b_rows = b_ptr + slot.to(tl.int64) * stride_bl + offs_r[:, None].to(tl.int64) * stride_br
    g_rows = gu_ptr + tok[:, None] * stride_gt
    a_rows = act_ptr + tok[:, None] * stride_at
    if USE_PDL:
        gdc_wait()  # y (the shrink) and gate_up (the base projection) are written by earlier launches
    yg = tl.load(y_rows, mask=m_mask[:, None] & rg_mask[None, :], other=0.0)
    yu = tl.load(y_rows + stride_ys, mask=m_mask[:, None] & ru_mask[None, :], other=0.0)
    for p in tl.static_range(1, SPLIT_K):
        p_mask = (offs_m * 0 + p) < parts  # a tensor compare: the interpreter rejects a scalar-broadcast mask
        yg += tl.load(y_rows + p * stride_yp, mask=m_mask[:, None] & rg_mask[None, :] & p_mask[:, None], other=0.0)
        yu += tl.load(y_rows + p * stride_yp + stride_ys, mask=m_mask[:, None] & ru_mask[None, :] & p_mask[:, None],
                      other=0.0)
    yg = yg.to(b_ptr.dtype.element_ty)
    yu = yu.to(b_ptr.dtype.element_ty)
    if PREFETCH:
        # gate and up feed no dot, so the compiler does not pipeline their loads: each next tile is loaded one
        # trip ahead, its latency overlapping this trip's B loads, dots and store
        first = m_mask[:, None] & ((n_lo + offs_bn) < n_hi)[None, :]
        g_nxt = tl.load(g_rows + (n_lo + offs_bn)[None, :], mask=first, other=0.0)
        u_nxt = tl.load(g_rows + (width + n_lo + offs_bn)[None, :], mask=first, other=0.0)
    for n0 in range(n_lo, n_hi, BLOCK_N):
        offs_n = n0 + offs_bn
        n_mask = offs_n < n_hi
        mask = m_mask[:, None] & n_mask[None, :]
        if PREFETCH:
            g = g_nxt
            u = u_nxt
            nxt_mask = m_mask[:, None] & ((offs_n + BLOCK_N) < n_hi)[None, :]
            g_nxt = tl.load(g_rows + (offs_n + BLOCK_N)[None, :], mask=nxt_mask, other=0.0)
            u_nxt = tl.load(g_rows + (width + offs_n + BLOCK_N)[None, :], mask=nxt_mask, other=0.0)
        else:
            g = tl.load(g_rows + offs_n[None, :], mask=mask, other=0.0)
            u = tl.load(g_rows + (width + offs_n)[None, :], mask=mask, other=0.0)
        bg = tl.load(b_rows + offs_n[None, :], mask=rg_mask[:, None] & n_mask[None, :], other=0.0)
        bu = tl.load(b_rows + (width + offs_n)[None, :], mask=ru_mask[:, None] & n_mask[None, :], other=0.0)
        g = (g.to(tl.float32) + tl.dot(yg, bg, input_precision=DOT_PRECISION) * scale).to(g.dtype)
        u = (u.to(tl.float32) + tl.dot(yu, bu, input_precision=DOT_PRECISION) * scale).to(u.dtype)
        tl.store(a_rows + offs_n[None, :], _silu_times(g, u, act_ptr.dtype.element_ty), mask=mask)


def lora_silu_mul(
    gate_up: torch.Tensor,  # [T, 2I], the base projection's output (gate first), not modified
    y: torch.Tensor,  # [SPLIT_K, 2, T, R] float32: the gate|up shrink's partials
    lora_b: torch.Tensor,  # [num_slots, R, 2I]
    ranks: torch.Tensor,  # [2, num_slots] int32
    scaling: torch.Tensor,  # [num_slots] float32
    meta: LoRAKernelMeta,
    *,
    shrink_progs: int | None = None,  # the shrink's ``progs`` and K tiles: which partials of y are valid;
    k_tiles: int | None = None,  # None: all y.shape[0] of them
    block_n: int = 128,
    n_splits: int | None = None,  # adapter programs per chunk along I; default one tile each
    base_block_m: int = 16,
    num_warps: int = 4,
    num_stages: int = 2,
    pdl: bool = False,  # programmatic dependent launch (sm_90+; the caller checks ``pdl_supported``)
    chunk_ranks: torch.Tensor | None = None,  # [2, max_chunks] int32 (with meta.chunk_tokens: per-chunk tables)
    prefetch: bool = False,  # gate and up tiles loaded one trip ahead
) -> torch.Tensor:
    """``silu(gate + dg) * (up + du)`` -> [T, I] (semantics in the module docstring). The launch options are the
    expand's (``lora_expand``): ``n_splits`` / ``block_n`` of its configuration, PDL, the per-chunk tables."""
    split_k, num_slices, num_tokens, max_rank = y.shape
    num_slots, b_rank, n_total = lora_b.shape
    assert num_slices == 2 and n_total % 2 == 0, "gate|up: two slices of equal width"
    assert gate_up.shape == (num_tokens, n_total) and gate_up.stride(1) == 1
    assert b_rank == max_rank and lora_b.stride(2) == 1 and lora_b.dtype == gate_up.dtype
    assert y.dtype == torch.float32 and scaling.dtype == torch.float32
    assert ranks.shape == (2, num_slots) and ranks.dtype == torch.int32 and ranks.stride(1) == 1
    assert meta.num_tokens == num_tokens and meta.num_slots == num_slots
    assert (shrink_progs is None) == (k_tiles is None), "shrink_progs and k_tiles come together"
    width = n_total // 2
    act = torch.empty(num_tokens, width, dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens == 0:
        return act
    if shrink_progs is None:
        shrink_progs, k_tiles = split_k * meta.max_chunks, split_k
    tiles = cdiv(width, block_n)
    progs = expand_progs(width, block_n, n_splits, meta.max_chunks)
    base_splits = max(1, min(tiles, 128 // max(1, cdiv(num_tokens, base_block_m))))
    grid = (progs + cdiv(num_tokens, base_block_m) * base_splits,)
    tables = chunk_tables(meta, chunk_ranks, 2)
    # every row and tile edge a multiple of 16 elements (bf16: 32 bytes), else the scalar accesses
    col_align = slice_col_align([0, width, gate_up.stride(0), act.stride(0)])
    _lora_silu_mul_kernel[grid](
        gate_up, y, lora_b, act, ranks, scaling, meta.token_slots,
        meta.sorted_token_ids, meta.chunk_slots, meta.chunk_starts, meta.chunk_lens, num_chunks_of(meta),
        *tables,
        progs, shrink_progs, k_tiles, num_tokens, width, base_splits,
        gate_up.stride(0), y.stride(0), y.stride(1), y.stride(2), y.stride(3), lora_b.stride(0), lora_b.stride(1),
        act.stride(0), ranks.stride(0), tables[1].stride(0),
        SPLIT_K=split_k, BLOCK_M=meta.block_m, BLOCK_N=block_n, BLOCK_R=max(16, next_power_of_2(max_rank)),
        BASE_BLOCK_M=base_block_m, DOT_PRECISION=dot_precision(gate_up.dtype), COL_ALIGN=min(col_align, block_n),
        USE_PDL=pdl, CHUNK_TABLES=tables[0] is not meta.chunk_slots, PREFETCH=prefetch,
        num_warps=num_warps, num_stages=num_stages, **({"launch_pdl": True} if pdl else {}),
    )
    return act


def lora_silu_mul_ref(gate_up: torch.Tensor, y: torch.Tensor, lora_b: torch.Tensor, token_slots: torch.Tensor,
                      ranks: torch.Tensor, scaling: torch.Tensor) -> torch.Tensor:
    """Twin: the expand into a copy of gate_up (``lora_expand_ref``; y [2, T, R], partials summed), then
    ``silu_mul_ref``."""
    from loraplex.kernels.fused_ops_ref import silu_mul_ref
    from loraplex.kernels.lora_ref import lora_expand_ref

    width = gate_up.shape[1] // 2
    out = lora_expand_ref(y, lora_b, token_slots, ranks, scaling, [0, width, 2 * width], gate_up.clone())
    return silu_mul_ref(out)
