"""LoRA expand in Triton: out += scaling * (y @ B), several slices per launch, in place.

Semantics (twin: ``lora_ref.lora_expand_ref``), for token t with slot l = token_slots[t] >= 0, slice s with
r = rank[s, l] > 0, column n of slice s (slice_loc[s] <= n < slice_loc[s+1]):

    y_t[j]    = sum_{p < P} y[p, s, t, j]                    (split-K partials of the shrink, j < r)
    out[t, n] = cast(float32(out[t, n]) + scaling[l] * sum_{j<r} y_t[j] * B[l, j, n])

Rows of slot -1 tokens and slices an adapter does not target are never written (bit-identical).

``accumulate=False`` (the write-first order of large steps, ``LoRAStep`` with ``expand_first_min_tokens``): out is
not read; every row of a token with an adapter gets ``cast(scaling[l] * sum_j y_t[j] * B[l, j, n])``, zeros in the
slices its adapter does not target. Rows of slot -1 tokens are not written, or with ``zero_base`` get zeros:
extra programs (beyond the chunks' ones) store them, so the caller need not clear out first (inside a decode CUDA
graph, which cannot know whether a step has base tokens, that was one memset launch and one pass over every
projection's output). The base GEMM then accumulates into out (beta = 1), so the projection's output is read once,
by the GEMM's epilogue, instead of once more by the expand.

``y_slot_stride`` (the shrink folded into the base GEMM, ``LoRAStep`` with ``gemm_shrink``): y is then the GEMM's
extra output columns, one group of S * R per slot, so token t reads ``y[0, s, t, j]`` shifted by its slot times
``y_slot_stride``; y may then be in the model dtype (it is rounded to B's dtype before the product either way).

Shape:
    y          [SPLIT_K, S, T, R] float32      shrink partials (P of them valid: ``split_parts`` of the shrink)
    lora_b     [num_slots, R, N_total]         B transposed: rank rows packed first, columns contiguous
    ranks      [S, num_slots] int32
    scaling    [num_slots] float32
    slice_loc  [S + 1] int32                   column offsets, unequal widths allowed (GQA q|k|v)
    out        [T, N_total]                    base projection output, updated in place

Grid: (progs, S), ``progs`` fixed on the host. The programs of a slice are spread over the chunks in use
(``meta.num_chunks`` = C, read on the device): each chunk gets progs // C programs, each adding a share
(whole BLOCK_N tiles) of the slice's columns, so one adapter's few chunks are spread over as many programs
as many adapters' many chunks (CUDA-graph safe: the grid never depends on the batch). Each program loads
y once and loops over its tiles (B pipelined by the compiler, the next ``out`` tile loaded one trip ahead);
programs beyond their slice's width, of unused chunks or of rank-0 slices exit at once. Each chunk's
tokens are distinct and slices own disjoint columns, so stores never race. With ``chunk_ranks`` (and
``meta.chunk_tokens``) slot, rank and tokens are read by chunk in one round trip (as in the shrink).

Programmatic dependent launch (``pdl``): the launch may start while the shrink runs; metadata, slot and
rank are read first, then every program that reads y / out waits for the shrink (griddepcontrol.wait), and
program 0 always waits, so this launch never completes before its predecessor. B (the adapter's weights,
never written by the step) need not wait: ``weight_prefetch`` loads the program's first B tile into registers
("first"), or its whole share of B into L2 ("l2"), before the wait, so those bytes move while the shrink ends.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels.host_math import cdiv, next_power_of_2
from loraplex.kernels.launch import fast_launch
from loraplex.kernels.lora_meta import LoRAKernelMeta
from loraplex.kernels.lora_shrink import (
    chunk_rows,
    chunk_tables,
    dot_precision,
    gdc_wait,
    l2_prefetch,
    num_chunks_of,
    split_parts,
    weight_prefetch_mode,
)

# as the shrink: no variant per token count
UNSPECIALIZED = ("progs", "shrink_progs", "k_tiles", "stride_yp", "stride_ys", "stride_crs", "num_tokens",
                 "zero_splits")


@triton.jit
def _b_tile(b_rows, offs_n, r_mask, n_hi, stride_bn):
    """One B tile [BLOCK_R, BLOCK_N]: columns ``offs_n`` of the slot's rows, masked beyond its rank and the
    program's columns."""
    return tl.load(b_rows + offs_n[None, :].to(tl.int64) * stride_bn, mask=r_mask[:, None] & (offs_n < n_hi)[None, :],
                   other=0.0)


@triton.jit
def column_share(width, splits, BLOCK_N: tl.constexpr):
    """Columns per program when ``splits`` programs share ``width``: whole BLOCK_N tiles."""
    share = (width + splits - 1) // splits
    return (share + BLOCK_N - 1) // BLOCK_N * BLOCK_N


@triton.jit
def _zero_base_rows(out_ptr, sorted_ids_ptr, chunk_starts_ptr, chunk_lens_ptr, num_chunks_ptr, slice_loc_ptr,
                    z, sl, zero_splits, num_tokens, stride_ot, stride_on,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, COL_ALIGN: tl.constexpr, USE_PDL: tl.constexpr):
    """Zero program ``z`` of slice ``sl``: zeros in its share of the slice's columns for BLOCK_M rows of tokens
    without an adapter. Those tokens sort after every chunk's (``sorted_token_ids``), from the end of the last
    chunk in use; a program whose rows lie beyond T stores nothing."""
    num_chunks = tl.load(num_chunks_ptr)
    last = tl.maximum(num_chunks - 1, 0)
    base_start = tl.load(chunk_starts_ptr + last) + tl.load(chunk_lens_ptr + last)
    base_start = tl.where(num_chunks > 0, base_start, 0)
    row0 = base_start + (z // zero_splits) * BLOCK_M
    rows = row0 + tl.arange(0, BLOCK_M)
    m_mask = rows < num_tokens
    tok = tl.load(sorted_ids_ptr + rows, mask=m_mask, other=0).to(tl.int64)
    n_begin = tl.load(slice_loc_ptr + sl)
    n_end = tl.load(slice_loc_ptr + sl + 1)
    if COL_ALIGN > 1:
        n_begin = tl.multiple_of(n_begin, COL_ALIGN)
        n_end = tl.multiple_of(n_end, COL_ALIGN)
    share = column_share(n_end - n_begin, zero_splits, BLOCK_N)
    n_lo = n_begin + (z % zero_splits) * share
    n_hi = tl.minimum(n_lo + share, n_end)
    n_hi = tl.where(row0 < num_tokens, n_hi, n_lo)  # no base row here: no trip
    o_rows = out_ptr + tok[:, None] * stride_ot
    offs_bn = tl.arange(0, BLOCK_N)
    zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=out_ptr.dtype.element_ty)
    if USE_PDL:
        gdc_wait()  # out's memory may have been another tensor's, still read by an earlier launch
    for n0 in range(n_lo, n_hi, BLOCK_N):
        offs_n = n0 + offs_bn
        tl.store(o_rows + offs_n[None, :].to(tl.int64) * stride_on, zeros,
                 mask=m_mask[:, None] & (offs_n < n_hi)[None, :])


@triton.jit
def expand_program(
    pid, sl,
    y_ptr, b_ptr, out_ptr, ranks_ptr, scaling_ptr, slice_loc_ptr,
    sorted_ids_ptr, chunk_slots_ptr, chunk_starts_ptr, chunk_lens_ptr, num_chunks_ptr,
    chunk_tokens_ptr, chunk_ranks_ptr, done_ptr,
    progs, shrink_progs, k_tiles, num_slices, num_pairs,
    stride_yp, stride_ys, stride_yt, stride_yr, stride_yl,
    stride_bl, stride_br, stride_bn,
    stride_ot, stride_on,
    stride_rs, stride_crs,
    SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    DOT_PRECISION: tl.constexpr, COL_ALIGN: tl.constexpr, USE_PDL: tl.constexpr,
    PREFETCH_OUT: tl.constexpr, CHUNK_TABLES: tl.constexpr, ACCUMULATE: tl.constexpr,
    PREFETCH_B: tl.constexpr, PF_LINE: tl.constexpr, WAIT: tl.constexpr, SHRINK_BLOCK_R: tl.constexpr,
    Y_CACHE: tl.constexpr,
):
    """Program (pid, sl) of the expand grid (module doc). ``WAIT`` (the one-launch ticketed kernel, lora_ticketed.py):
    before reading y the program waits until every shrink program of its (chunk, slice) in the same launch has counted
    itself in ``done_ptr[chunk * num_slices + sl]`` (acquire, GPU scope), then reads y from L2 (``Y_CACHE`` ".cg"); the
    last of the pair's expand programs past the wait sets the pair's two counters (done, and past-the-wait at
    ``num_pairs`` further on) back to 0 for the next launch. A count found above the wait's target is added to
    ``done_ptr[2 * num_pairs + 1]`` (kept: a test reads it)."""
    num_chunks = tl.load(num_chunks_ptr)
    per_chunk = progs // tl.maximum(num_chunks, 1)
    chunk = pid // per_chunk
    n_split = pid % per_chunk
    if chunk >= num_chunks:
        return
    offs_m = tl.arange(0, BLOCK_M)
    if CHUNK_TABLES:
        # slot, rank and tokens all indexed by the chunk: one round trip, not three in a row
        slot = tl.load(chunk_slots_ptr + chunk)
        rank = tl.load(chunk_ranks_ptr + sl * stride_crs + chunk)
        tok = tl.load(chunk_tokens_ptr + chunk * BLOCK_M + offs_m)
    else:
        slot = tl.load(chunk_slots_ptr + chunk)
        rank = tl.load(ranks_ptr + sl * stride_rs + tl.maximum(slot, 0))
        tok = tl.zeros((BLOCK_M,), dtype=tl.int32)
    if slot < 0:
        return
    if ACCUMULATE:
        if rank == 0:
            return  # (written: a rank-0 slice masks every y and B load to zero, so its rows get zeros)
    n_begin = tl.load(slice_loc_ptr + sl)
    n_end = tl.load(slice_loc_ptr + sl + 1)
    if COL_ALIGN > 1:
        # column offsets loaded from memory have unknown alignment, so without this hint every B / out
        # access is a 2-byte scalar and the N loop is not pipelined (no cp.async); the caller guarantees
        # that every slice offset is a multiple of COL_ALIGN
        n_begin = tl.multiple_of(n_begin, COL_ALIGN)
        n_end = tl.multiple_of(n_end, COL_ALIGN)
    # this program's columns: a 1/per_chunk share of the slice, whole BLOCK_N tiles
    share = column_share(n_end - n_begin, per_chunk, BLOCK_N)
    n_lo = n_begin + n_split * share
    if n_lo >= n_end:
        return
    n_hi = tl.minimum(n_lo + share, n_end)
    tok, m_mask = chunk_rows(tok, chunk, offs_m, sorted_ids_ptr, chunk_starts_ptr, chunk_lens_ptr, CHUNK_TABLES)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    scale = tl.load(scaling_ptr + slot)
    parts, _ = split_parts(shrink_progs, num_chunks, SPLIT_K, k_tiles)
    y_ptrs = (y_ptr + slot.to(tl.int64) * stride_yl + sl * stride_ys + tok[:, None] * stride_yt
              + offs_r[None, :] * stride_yr)
    y_mask = m_mask[:, None] & r_mask[None, :]
    b_rows = b_ptr + slot.to(tl.int64) * stride_bl + offs_r[:, None].to(tl.int64) * stride_br
    o_rows = out_ptr + tok[:, None] * stride_ot
    offs_bn = tl.arange(0, BLOCK_N)
    if PREFETCH_B == 1:
        # B is the adapter's weights, written before this step: its first tile is loaded before the wait, so
        # with PDL that load overlaps the shrink's last programs; the loop then loads each next tile one ahead
        b_nxt = _b_tile(b_rows, n_lo + offs_bn, r_mask, n_hi, stride_bn)
    if PREFETCH_B == 2:
        # every line of this program's B share into L2 before the wait; the pipelined loop then reads it from there
        offs_pf = tl.arange(0, BLOCK_N // PF_LINE) * PF_LINE
        pf_rows = (b_ptr + slot.to(tl.int64) * stride_bl
                   + tl.where(r_mask, offs_r, 0)[:, None].to(tl.int64) * stride_br)
        for n0 in range(n_lo, n_hi, BLOCK_N):
            l2_prefetch(pf_rows + tl.minimum(n0 + offs_pf, n_hi - 1)[None, :].to(tl.int64) * stride_bn)
    if USE_PDL:
        gdc_wait()  # y (the shrink) and out (the base projection) are written by earlier launches
    if WAIT:
        pair = chunk * num_slices + sl
        want = parts * tl.cdiv(rank, SHRINK_BLOCK_R)  # the K parts of each rank tile the shrink ran
        seen = tl.atomic_add(done_ptr + pair, 0, sem="acquire", scope="gpu")
        while seen < want:
            seen = tl.atomic_add(done_ptr + pair, 0, sem="acquire", scope="gpu")
        if seen != want:
            # a count above ``want``: shrink and expand disagree on the pair's programs, so y may have been read
            # before its last partial; counted (never reset) in the entry after the ticket, which the tests read
            tl.atomic_add(done_ptr + 2 * num_pairs + 1, 1, sem="relaxed", scope="gpu")
        tl.debug_barrier()  # no thread reads y before the count was seen whole
        users = (n_end - n_begin + share - 1) // share  # the pair's expand programs with columns (all wait)
        used = tl.atomic_add(done_ptr + num_pairs + pair, 1, sem="relaxed", scope="gpu")
        if used == users - 1:  # every other one is past its wait: both counters back to 0 for the next launch
            tl.store(done_ptr + pair, 0)
            tl.store(done_ptr + num_pairs + pair, 0)
    # (WAIT: partials stored by other SMs during this launch are read from L2, never a stale L1 line)
    ys = tl.load(y_ptrs, mask=y_mask, other=0.0, cache_modifier=Y_CACHE)
    for p in tl.static_range(1, SPLIT_K):
        # (a tensor compare: the interpreter rejects a mask broadcast from a scalar one)
        p_mask = (offs_m * 0 + p) < parts
        ys += tl.load(y_ptrs + p * stride_yp, mask=y_mask & p_mask[:, None], other=0.0, cache_modifier=Y_CACHE)
    ys = ys.to(b_ptr.dtype.element_ty)
    if PREFETCH_OUT and ACCUMULATE:
        # out is read-modify-written per tile; its load is not pipelined by the compiler, so the next tile's
        # load is issued one trip ahead (its latency overlaps this trip's B load, dot and store)
        nxt = tl.load(o_rows + (n_lo + offs_bn)[None, :].to(tl.int64) * stride_on,
                      mask=m_mask[:, None] & ((n_lo + offs_bn) < n_hi)[None, :], other=0.0)
        for n0 in range(n_lo, n_hi, BLOCK_N):
            offs_n = n0 + offs_bn
            n_mask = offs_n < n_hi
            base = nxt
            offs_nx = offs_n + BLOCK_N
            nxt = tl.load(o_rows + offs_nx[None, :].to(tl.int64) * stride_on,
                          mask=m_mask[:, None] & (offs_nx < n_hi)[None, :], other=0.0)
            if PREFETCH_B == 1:
                b = b_nxt
                b_nxt = _b_tile(b_rows, offs_n + BLOCK_N, r_mask, n_hi, stride_bn)
            else:
                b = _b_tile(b_rows, offs_n, r_mask, n_hi, stride_bn)
            acc = tl.dot(ys, b, input_precision=DOT_PRECISION) * scale
            o_ptrs = o_rows + offs_n[None, :].to(tl.int64) * stride_on
            tl.store(o_ptrs, (base.to(tl.float32) + acc).to(base.dtype), mask=m_mask[:, None] & n_mask[None, :])
    else:
        for n0 in range(n_lo, n_hi, BLOCK_N):
            offs_n = n0 + offs_bn
            n_mask = offs_n < n_hi
            if PREFETCH_B == 1:
                b = b_nxt
                b_nxt = _b_tile(b_rows, offs_n + BLOCK_N, r_mask, n_hi, stride_bn)
            else:
                b = _b_tile(b_rows, offs_n, r_mask, n_hi, stride_bn)
            acc = tl.dot(ys, b, input_precision=DOT_PRECISION) * scale
            o_ptrs = o_rows + offs_n[None, :].to(tl.int64) * stride_on
            o_mask = m_mask[:, None] & n_mask[None, :]
            if ACCUMULATE:  # read-modify-write (accumulate=False: out is not read)
                acc += tl.load(o_ptrs, mask=o_mask, other=0.0).to(tl.float32)
            tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=o_mask)



@fast_launch
@triton.jit(do_not_specialize=UNSPECIALIZED)
def _lora_expand_kernel(
    y_ptr, b_ptr, out_ptr, ranks_ptr, scaling_ptr, slice_loc_ptr,
    sorted_ids_ptr, chunk_slots_ptr, chunk_starts_ptr, chunk_lens_ptr, num_chunks_ptr,
    chunk_tokens_ptr, chunk_ranks_ptr,
    progs, shrink_progs, k_tiles, num_tokens, zero_splits,
    stride_yp, stride_ys, stride_yt, stride_yr, stride_yl,
    stride_bl, stride_br, stride_bn,
    stride_ot, stride_on,
    stride_rs, stride_crs,
    SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    DOT_PRECISION: tl.constexpr, COL_ALIGN: tl.constexpr = 1, USE_PDL: tl.constexpr = False,
    PREFETCH_OUT: tl.constexpr = True, CHUNK_TABLES: tl.constexpr = False, ACCUMULATE: tl.constexpr = True,
    PREFETCH_B: tl.constexpr = 0, PF_LINE: tl.constexpr = 64, ZERO_BASE: tl.constexpr = False,
):
    pid = tl.program_id(0)
    sl = tl.program_id(1)
    if USE_PDL:
        if (pid == 0) & (sl == 0):
            gdc_wait()
    if ZERO_BASE:
        if pid >= progs:  # the programs after the chunks' zero the rows of tokens without an adapter
            _zero_base_rows(out_ptr, sorted_ids_ptr, chunk_starts_ptr, chunk_lens_ptr, num_chunks_ptr, slice_loc_ptr,
                            pid - progs, sl, zero_splits, num_tokens, stride_ot, stride_on,
                            BLOCK_M, BLOCK_N, COL_ALIGN, USE_PDL)
            return
    expand_program(pid, sl, y_ptr, b_ptr, out_ptr, ranks_ptr, scaling_ptr, slice_loc_ptr,
                   sorted_ids_ptr, chunk_slots_ptr, chunk_starts_ptr, chunk_lens_ptr, num_chunks_ptr,
                   chunk_tokens_ptr, chunk_ranks_ptr, y_ptr,
                   progs, shrink_progs, k_tiles, 0, 0,
                   stride_yp, stride_ys, stride_yt, stride_yr, stride_yl,
                   stride_bl, stride_br, stride_bn, stride_ot, stride_on, stride_rs, stride_crs,
                   SPLIT_K=SPLIT_K, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_R=BLOCK_R, DOT_PRECISION=DOT_PRECISION,
                   COL_ALIGN=COL_ALIGN, USE_PDL=USE_PDL, PREFETCH_OUT=PREFETCH_OUT, CHUNK_TABLES=CHUNK_TABLES,
                   ACCUMULATE=ACCUMULATE, PREFETCH_B=PREFETCH_B, PF_LINE=PF_LINE, WAIT=False, SHRINK_BLOCK_R=16,
                   Y_CACHE="")


def expand_progs(width: int, block_n: int, n_splits: int | None, max_chunks: int) -> int:
    """Programs per slice of an expand grid: ``n_splits`` per chunk (default one per BLOCK_N tile of the widest
    slice, ``width``; at least 1, at most that many), for every chunk the step may use."""
    tiles = cdiv(width, block_n)
    return (tiles if n_splits is None else max(1, min(n_splits, tiles))) * max_chunks


def slice_col_align(slice_loc: list[int]) -> int:
    """Largest power of two (<= 16) dividing every slice offset: the COL_ALIGN hint that is true for them."""
    align = 16
    while align > 1 and any(v % align for v in slice_loc):
        align //= 2
    return align


def lora_expand(
    y: torch.Tensor,  # [SPLIT_K, S, T, R] float32
    lora_b: torch.Tensor,  # [num_slots, R, N_total]
    ranks: torch.Tensor,  # [S, num_slots] int32
    scaling: torch.Tensor,  # [num_slots] float32
    slice_loc: torch.Tensor,  # [S + 1] int32 on the device
    max_slice_width: int,  # max_s slice_loc[s+1] - slice_loc[s], known on the host
    meta: LoRAKernelMeta,
    out: torch.Tensor,  # [T, N_total], updated in place
    *,
    block_n: int = 128,
    n_splits: int | None = None,  # programs per chunk and slice along N (distinct adapters); default one tile each
    num_warps: int = 4,
    num_stages: int = 3,
    col_align: int = 1,  # every slice_loc value is a multiple of this (slice_col_align): lets B / out vectorize
    shrink_progs: int | None = None,  # the shrink's ``progs`` and K tiles: which partials of y are valid;
    k_tiles: int | None = None,  # None: all y.shape[0] of them
    pdl: bool = False,
    prefetch_out: bool = True,
    chunk_ranks: torch.Tensor | None = None,  # [S, max_chunks] int32 (with meta.chunk_tokens: per-chunk tables)
    accumulate: bool = True,  # False: write the delta (zeros in untargeted slices), out not read (module doc)
    weight_prefetch: str = "off",  # before the PDL wait: "first" B tile into registers, or the "l2" share into L2
    y_slot_stride: int = 0,  # y of token t with slot l at y[p, s, t, r] + l * y_slot_stride (the in-GEMM shrink)
    zero_base: bool = False,  # with accumulate=False: rows of slot -1 tokens get zeros (module doc)
) -> torch.Tensor:
    split_k, num_slices, num_tokens, max_rank = y.shape
    num_slots, b_rank, n_total = lora_b.shape
    assert b_rank == max_rank, f"y has R={max_rank}, lora_b has R={b_rank}"
    assert out.shape == (num_tokens, n_total), f"out is {tuple(out.shape)}, want ({num_tokens}, {n_total})"
    assert out.dtype == lora_b.dtype, f"out is {out.dtype}, lora_b is {lora_b.dtype}"
    assert y.dtype in (torch.float32, out.dtype) and scaling.dtype == torch.float32
    assert ranks.shape == (num_slices, num_slots) and ranks.dtype == torch.int32 and ranks.stride(1) == 1
    assert slice_loc.shape == (num_slices + 1,) and slice_loc.dtype == torch.int32
    assert lora_b.stride(2) == 1, "lora_b must be contiguous along N"
    assert meta.num_tokens == num_tokens and meta.num_slots == num_slots
    assert col_align in (1, 2, 4, 8, 16) and col_align <= block_n, "col_align: a power of two <= 16 and <= block_n"
    assert (shrink_progs is None) == (k_tiles is None), "shrink_progs and k_tiles come together"
    assert not (zero_base and accumulate), "zero_base needs accumulate=False"
    assert not zero_base or meta.num_chunks is not None, "zero_base needs meta.num_chunks (where base rows start)"
    if num_tokens == 0 or meta.max_chunks == 0:
        return out
    if shrink_progs is None:  # every partial valid: P = split_k for any chunk count
        shrink_progs, k_tiles = split_k * meta.max_chunks, split_k
    block_r = max(16, next_power_of_2(max_rank))
    max_tiles = cdiv(max_slice_width, block_n)
    progs = expand_progs(max_slice_width, block_n, n_splits, meta.max_chunks)
    # zero_base: programs for every block of BLOCK_M rows that may hold base tokens, each zeroing a share of a
    # slice's columns (a few tiles each; at most ~1,024 per slice, most exiting at once when few tokens lack one)
    row_blocks = cdiv(num_tokens, meta.block_m)
    zero_splits = max(1, min(cdiv(max_tiles, 4), cdiv(1024, row_blocks))) if zero_base else 1
    grid = (progs + (row_blocks * zero_splits if zero_base else 0), num_slices)
    tables = chunk_tables(meta, chunk_ranks, num_slices)
    prefetch, line = weight_prefetch_mode(weight_prefetch, lora_b.dtype, block_n)
    _lora_expand_kernel[grid](
        y, lora_b, out, ranks, scaling, slice_loc,
        meta.sorted_token_ids, meta.chunk_slots, meta.chunk_starts, meta.chunk_lens, num_chunks_of(meta),
        *tables,
        progs, shrink_progs, k_tiles, num_tokens, zero_splits,
        y.stride(0), y.stride(1), y.stride(2), y.stride(3), y_slot_stride,
        lora_b.stride(0), lora_b.stride(1), lora_b.stride(2),
        out.stride(0), out.stride(1),
        ranks.stride(0), tables[1].stride(0),
        SPLIT_K=split_k, BLOCK_M=meta.block_m, BLOCK_N=block_n, BLOCK_R=block_r,
        DOT_PRECISION=dot_precision(out.dtype), COL_ALIGN=col_align, USE_PDL=pdl, PREFETCH_OUT=prefetch_out,
        CHUNK_TABLES=tables[0] is not meta.chunk_slots, ACCUMULATE=accumulate, PREFETCH_B=prefetch, PF_LINE=line,
        ZERO_BASE=zero_base, num_warps=num_warps, num_stages=num_stages, **({"launch_pdl": True} if pdl else {}),
    )
    return out
