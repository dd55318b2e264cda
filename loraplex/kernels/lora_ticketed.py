"""LoRA shrink and expand of one projection in ONE launch, the expand waiting on per-(chunk, slice) counts.

Semantics (twin: ``lora_ref.lora_apply_ref``): exactly those of ``lora_shrink`` followed by ``lora_expand`` with the
same configuration (the same programs run, from the same code: ``shrink_program`` and ``expand_program``).

Why: a 64-token decode step on 64 distinct rank-16 adapters runs its LoRA work as 256 dependent launches (shrink and
expand of four projection groups in 32 layers). On an H100 the launch chain alone took 0.46-0.58 ms of that step
(docs/benchmarks/H100-2026-12-06-run26.md), against a bandwidth floor of 1.9 ms; on the H200 the step took 2.41 ms
against a floor of 1.375. Fusing the pair the way ``lora_fused`` does (one program both shrinks and expands) made
every decode projection slower: either each program recomputes y (A read n_splits times) or one program expands a
whole slice. Here the two grids stay as they are, in one launch:

- Each program takes a ticket (an atomic counter) and runs work item ``ticket``: items below ``n_shrink`` are the
  shrink grid's programs (slice-major, so slice 0's shrinks are handed out first), the rest the expand grid's.
- A shrink program stores its fp32 partial, then counts itself into ``done[chunk, slice]`` (release, GPU scope).
- An expand program of (chunk, slice) waits until that count reaches the number of shrink programs of the pair
  (``parts`` K parts times its rank tiles), reads y from L2, and expands as ``lora_expand``.

Tickets, not program ids, give the order: by the time any program holds an expand item, every shrink item has
been handed to a program that is already running and waits on nothing, so the waits always end, whatever the
grid size and however the hardware schedules blocks (the decoupled look-back argument). The last ticket resets the
ticket counter; the last expand program of each pair past its wait resets the pair's counters; so every launch
leaves ``counters`` at zero and consecutive launches (layers, projections, CUDA graph replays) share them. Under
TRITON_INTERPRET=1 programs run one after another in ticket order, so every shrink item finishes before the first
expand item asks, and the same code runs on the CPU.

Shapes as ``lora_shrink`` / ``lora_expand``; ``counters``: [>= 2 * max_chunks * S + 2] int32 (``counters_size``), zero
before the first launch. Grid: (shrink_progs * r_tiles * S + expand_progs * S,). One ``num_warps`` for both halves.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels.host_math import cdiv, next_power_of_2
from loraplex.kernels.launch import fast_launch
from loraplex.kernels.lora_expand import expand_program, expand_progs
from loraplex.kernels.lora_meta import LoRAKernelMeta, check_apply_args
from loraplex.kernels.lora_shrink import (
    X_STORED,
    chunk_tables,
    dot_precision,
    gdc_wait,
    num_chunks_of,
    shrink_program,
)

UNSPECIALIZED = ("shrink_progs", "expand_progs", "k_tiles", "num_pairs", "stride_yp", "stride_ys", "stride_crs")


@fast_launch
@triton.jit(do_not_specialize=UNSPECIALIZED)
def _lora_ticketed_kernel(
    x_ptr, a_ptr, y_ptr, b_ptr, out_ptr, ranks_ptr, scaling_ptr, slice_loc_ptr,
    sorted_ids_ptr, chunk_slots_ptr, chunk_starts_ptr, chunk_lens_ptr, num_chunks_ptr,
    chunk_tokens_ptr, chunk_ranks_ptr, cnt_ptr,
    K, shrink_progs, r_tiles, expand_progs, num_slices, num_pairs, k_tiles,
    stride_xt, stride_xk,
    stride_al, stride_as, stride_ar, stride_ak,
    stride_yp, stride_ys, stride_yt, stride_yr,
    stride_bl, stride_br, stride_bn,
    stride_ot, stride_on,
    stride_rs, stride_crs,
    SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr, EXPAND_BLOCK_R: tl.constexpr, DOT_PRECISION: tl.constexpr,
    COL_ALIGN: tl.constexpr = 1, USE_PDL: tl.constexpr = False, PREFETCH_OUT: tl.constexpr = True,
    CHUNK_TABLES: tl.constexpr = False,
):
    if USE_PDL:
        # x, out and the counters' last reset belong to earlier launches: wait for them before anything
        gdc_wait()
    n_shrink = shrink_progs * r_tiles * num_slices
    total = n_shrink + expand_progs * num_slices
    ticket_ptr = cnt_ptr + 2 * num_pairs
    item = tl.atomic_add(ticket_ptr, 1, sem="relaxed", scope="gpu")
    if item == total - 1:  # every other ticket is taken: ready for the next launch
        tl.store(ticket_ptr, 0)
    if item < n_shrink:
        pid = item % shrink_progs
        rest = item // shrink_progs
        shrink_program(pid, rest % r_tiles, rest // r_tiles, x_ptr, a_ptr, y_ptr, ranks_ptr,
                       sorted_ids_ptr, chunk_slots_ptr, chunk_starts_ptr, chunk_lens_ptr, num_chunks_ptr,
                       chunk_tokens_ptr, chunk_ranks_ptr, cnt_ptr,
                       K, shrink_progs, num_slices,
                       stride_xt, stride_xk, stride_al, stride_as, stride_ar, stride_ak,
                       stride_yp, stride_ys, stride_yt, stride_yr, stride_rs, stride_crs,
                       SPLIT_K=SPLIT_K, BLOCK_M=BLOCK_M, BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K, DOT_PRECISION=DOT_PRECISION,
                       USE_PDL=False, CHUNK_TABLES=CHUNK_TABLES, PREFETCH_A=0, PF_LINE=64, SIGNAL=True,
                       X_MODE=X_STORED)
    else:
        e = item - n_shrink
        expand_program(e % expand_progs, e // expand_progs, y_ptr, b_ptr, out_ptr, ranks_ptr, scaling_ptr,
                       slice_loc_ptr, sorted_ids_ptr, chunk_slots_ptr, chunk_starts_ptr, chunk_lens_ptr,
                       num_chunks_ptr, chunk_tokens_ptr, chunk_ranks_ptr, cnt_ptr,
                       expand_progs, shrink_progs, k_tiles, num_slices, num_pairs,
                       stride_yp, stride_ys, stride_yt, stride_yr, 0,
                       stride_bl, stride_br, stride_bn, stride_ot, stride_on, stride_rs, stride_crs,
                       SPLIT_K=SPLIT_K, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_R=EXPAND_BLOCK_R,
                       DOT_PRECISION=DOT_PRECISION, COL_ALIGN=COL_ALIGN, USE_PDL=False, PREFETCH_OUT=PREFETCH_OUT,
                       CHUNK_TABLES=CHUNK_TABLES, ACCUMULATE=True, PREFETCH_B=0, PF_LINE=64, WAIT=True,
                       SHRINK_BLOCK_R=BLOCK_R, Y_CACHE=".cg")


def counters_size(max_chunks: int, max_slices: int = 3) -> int:
    """int32 entries of the counters buffer for launches of up to ``max_slices`` slices and ``max_chunks`` chunks:
    done and past-the-wait per (chunk, slice), the ticket, and the miscount tally (``miscounts``)."""
    return 2 * max_chunks * max_slices + 2


def miscounts(counters: torch.Tensor, max_chunks: int, num_slices: int) -> int:
    """Expand programs that found their pair's shrink count above what they waited for, over every launch with
    ``counters`` of this layout (always 0 unless shrink and expand disagree: a bug; reading it syncs)."""
    return int(counters[2 * max_chunks * num_slices + 1].item())


def lora_ticketed(
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
    split_k: int = 1,  # most K parts per chunk (y holds this many partials), as lora_shrink
    shrink_progs: int | None = None,  # shrink programs per (rank tile, slice); default split_k * max_chunks
    block_r: int = 16,
    block_k: int = 128,
    block_n: int = 128,
    n_splits: int | None = None,  # expand programs per chunk and slice, as lora_expand
    y: torch.Tensor | None = None,  # [>= split_k, >= S, T, R] float32 scratch
    counters: torch.Tensor | None = None,  # [>= counters_size(max_chunks, S)] int32, zeros
    num_warps: int = 4,
    num_stages: int = 3,
    col_align: int = 1,
    pdl: bool = False,
    prefetch_out: bool = True,
    chunk_ranks: torch.Tensor | None = None,  # [S, max_chunks] int32 (with meta.chunk_tokens: per-chunk tables)
) -> torch.Tensor:
    """Semantics: ``lora_ref.lora_apply_ref``, in one launch (module doc)."""
    num_tokens, k_dim, num_slices, max_rank = check_apply_args(x, out, lora_a, lora_b, ranks, scaling, slice_loc, meta)
    assert meta.block_m >= 16 and block_r >= 16 and block_k >= 16 and block_n >= 16, "tl.dot needs tiles of 16"
    assert col_align in (1, 2, 4, 8, 16) and col_align <= block_n
    if num_tokens == 0 or meta.max_chunks == 0:
        return out
    if y is None:
        y = torch.empty(split_k, num_slices, num_tokens, max_rank, dtype=torch.float32, device=x.device)
    y = y[:split_k, :num_slices]
    assert y.shape == (split_k, num_slices, num_tokens, max_rank) and y.dtype == torch.float32
    num_pairs = meta.max_chunks * num_slices
    if counters is None:
        counters = torch.zeros(counters_size(meta.max_chunks, num_slices), dtype=torch.int32, device=x.device)
    assert counters.dtype == torch.int32 and counters.numel() >= counters_size(meta.max_chunks, num_slices), \
        "counters too small"
    shrink_progs = split_k * meta.max_chunks if shrink_progs is None else shrink_progs
    # every chunk needs a shrink program, or its expand programs would wait for ever
    assert shrink_progs >= meta.max_chunks, f"shrink_progs={shrink_progs} < max_chunks={meta.max_chunks}"
    r_tiles = cdiv(max_rank, block_r)
    e_progs = expand_progs(max_slice_width, block_n, n_splits, meta.max_chunks)
    grid = ((shrink_progs * r_tiles + e_progs) * num_slices,)
    tables = chunk_tables(meta, chunk_ranks, num_slices)
    _lora_ticketed_kernel[grid](
        x, lora_a, y, lora_b, out, ranks, scaling, slice_loc,
        meta.sorted_token_ids, meta.chunk_slots, meta.chunk_starts, meta.chunk_lens, num_chunks_of(meta),
        *tables, counters,
        k_dim, shrink_progs, r_tiles, e_progs, num_slices, num_pairs, cdiv(k_dim, block_k),
        x.stride(0), x.stride(1),
        lora_a.stride(0), lora_a.stride(1), lora_a.stride(2), lora_a.stride(3),
        y.stride(0), y.stride(1), y.stride(2), y.stride(3),
        lora_b.stride(0), lora_b.stride(1), lora_b.stride(2),
        out.stride(0), out.stride(1),
        ranks.stride(0), tables[1].stride(0),
        SPLIT_K=split_k, BLOCK_M=meta.block_m, BLOCK_R=block_r, BLOCK_K=block_k, BLOCK_N=block_n,
        EXPAND_BLOCK_R=max(16, next_power_of_2(max_rank)), DOT_PRECISION=dot_precision(x.dtype),
        COL_ALIGN=col_align, USE_PDL=pdl, PREFETCH_OUT=prefetch_out, CHUNK_TABLES=tables[0] is not meta.chunk_slots,
        num_warps=num_warps, num_stages=num_stages, **({"launch_pdl": True} if pdl else {}),
    )
    return out

