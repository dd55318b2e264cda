"""LoRA shrink in Triton: y = x @ A for a batch whose tokens carry their own adapter slot.

Semantics (twin: ``lora_ref.lora_shrink_ref``), for token t with slot l = token_slots[t] >= 0, slice s,
r < rank[s, l], part p < P:

    y[p, s, t, r] = sum_{k in part p} x[t, k] * A[l, s, r, k]      (float32 accumulate)
    sum_{p < P} y[p, s, t, r] == lora_shrink_ref(...)[s, t, r]

Entries of y for slot -1 tokens, r >= rank or p >= P are NOT written (the expand masks them).

Shape:
    x        [T, K]                  model dtype
    lora_a   [num_slots, S, R, K]    model dtype, rank rows packed first
    ranks    [S, num_slots] int32
    y        [SPLIT_K, S, T, R] float32 scratch

Grid: (progs, cdiv(R, BLOCK_R), S), ``progs`` fixed on the host (from buffer maxima, CUDA-graph safe). The
programs of a slice are spread over the chunks in use, read on the device (``meta.num_chunks`` = C):
each chunk gets P = parts(progs, C) programs, each summing a 1/P share of the K tiles (split-K), so one
adapter's few chunks are served by as many programs as many adapters' many chunks. ``parts`` (below) is
the same function in the expand, which sums exactly those P partials (two-pass, atomic-free: works under
TRITON_INTERPRET=1 and needs no zeroing). A program exits at once when its chunk is beyond C, or its
rank tile lies beyond the slot's real rank (so padding up to R is never read).

Per-chunk tables (``chunk_ranks`` [S, max_chunks] = ranks[:, chunk_slots], built once per step, and
``meta.chunk_tokens``): a program reads its slot, rank and tokens in one round trip instead of the chain
slot -> rank and start -> sorted ids; at decode sizes each kernel is mostly such latency (NOTES-lora.md).

Programmatic dependent launch (``pdl``, sm_90+, CUDA only): the launch may start while the previous kernel
(the base projection) finishes; every program that reads x waits for it first (griddepcontrol.wait), and
program 0 always waits, so this launch never completes before its predecessor. Each program also lets the
next launch (the expand) start once all of this grid has been scheduled.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels.fused_ops import silu_mul_values
from loraplex.kernels.host_math import cdiv
from loraplex.kernels.launch import fast_launch
from loraplex.kernels.lora_meta import LoRAKernelMeta

try:  # grid dependency control (programmatic dependent launch); triton >= 3.4
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older triton: pdl stays off
    gdc_launch_dependents = gdc_wait = None

PDL_AVAILABLE = gdc_wait is not None


@triton.jit
def split_parts(progs, num_chunks, SPLIT_K: tl.constexpr, k_tiles):
    """(P, tiles per part): P parts per chunk (<= SPLIT_K, <= k_tiles, P * num_chunks <= progs), none empty."""
    want = tl.minimum(tl.maximum(progs // tl.maximum(num_chunks, 1), 1), SPLIT_K)
    want = tl.minimum(want, k_tiles)
    per = (k_tiles + want - 1) // want
    return (k_tiles + per - 1) // per, per


@triton.jit
def l2_prefetch(ptrs):
    """``prefetch.global.L2`` of the line under each pointer (sm_80+; compiled kernels only, never the interpreter).
    Not pure, so the compiler keeps it although nothing reads its result."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def chunk_rows(tok, chunk, offs_m, sorted_ids_ptr, chunk_starts_ptr, chunk_lens_ptr, CHUNK_TABLES: tl.constexpr):
    """(token indices as int64, row mask) of a chunk's BLOCK_M rows: from its row of the token table, ``tok`` (loaded
    with its slot; -1 past its length), or without the tables by its start and length into the sorted ids (``tok``
    then unused)."""
    if CHUNK_TABLES:
        m_mask = tok >= 0
        rows = tl.maximum(tok, 0).to(tl.int64)
    else:
        start = tl.load(chunk_starts_ptr + chunk)
        length = tl.load(chunk_lens_ptr + chunk)
        m_mask = offs_m < length
        rows = tl.load(sorted_ids_ptr + start + offs_m, mask=m_mask, other=0).to(tl.int64)
    return rows, m_mask


def interpreted() -> bool:
    """TRITON_INTERPRET=1: the kernels run as Python (no inline assembly, no PDL, programs one after another)."""
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"


# weight prefetch before the PDL wait (``weight_prefetch`` of the launch policy): not at all, the first tile into
# registers (then each next one a trip ahead, the loop no longer pipelined by the compiler), or the program's whole
# share into L2 (the loop stays pipelined and reads it from L2)
WEIGHT_PREFETCH_CODES = {"off": 0, "first": 1, "l2": 2}


def weight_prefetch_mode(mode: str, dtype: torch.dtype, tile: int) -> tuple[int, int]:
    """(PREFETCH constexpr, elements per 128-byte line) for a launch; ``l2`` needs compiled kernels and a tile of
    whole lines, else it is dropped (the interpreter has no inline assembly)."""
    code = WEIGHT_PREFETCH_CODES[mode]
    line = max(1, 128 // (torch.finfo(dtype).bits // 8))
    if code == 2 and (interpreted() or tile < line):
        code = 0
    return code, line


# integer arguments that change with the step's token count are not specialized (Triton would compile a variant per
# value class: == 1, divisible by 16, other), so one compiled kernel serves every step of a launch configuration
UNSPECIALIZED = ("progs", "stride_yp", "stride_ys", "stride_crs")


X_STORED = tl.constexpr(0)  # x_tile: x as stored (constexpr: kernels read it as a global)
X_SILU_MUL = tl.constexpr(1)  # x = silu(gate) * up of a gate|up row [gate (K) | up (K)], rounded as ``fused_ops.silu_mul``


@triton.jit
def x_tile(x_ptrs, mask, up_offset, X_MODE: tl.constexpr):
    """One tile of the shrink's input x: loaded (``X_STORED``), or with ``X_SILU_MUL`` computed from the gate columns
    under ``x_ptrs`` and the up columns ``up_offset`` elements further (the down projection's input, recomputed
    from gate|up by the shrink folded into SiLU-and-multiply)."""
    if X_MODE == X_SILU_MUL:
        g = tl.load(x_ptrs, mask=mask, other=0.0)
        u = tl.load(x_ptrs + up_offset, mask=mask, other=0.0)
        return silu_mul_values(g, u)
    else:
        return tl.load(x_ptrs, mask=mask, other=0.0)


@triton.jit
def shrink_program(
    pid, r_tile, sl,
    x_ptr, a_ptr, y_ptr, ranks_ptr,
    sorted_ids_ptr, chunk_slots_ptr, chunk_starts_ptr, chunk_lens_ptr, num_chunks_ptr,
    chunk_tokens_ptr, chunk_ranks_ptr, done_ptr,
    K, progs, num_slices,
    stride_xt, stride_xk,
    stride_al, stride_as, stride_ar, stride_ak,
    stride_yp, stride_ys, stride_yt, stride_yr,
    stride_rs, stride_crs,
    SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr, CHUNK_TABLES: tl.constexpr,
    PREFETCH_A: tl.constexpr, PF_LINE: tl.constexpr, SIGNAL: tl.constexpr, X_MODE: tl.constexpr,
):
    """Program (pid, r_tile, sl) of the shrink grid (module doc). ``X_MODE`` (``x_tile``): x as stored, or computed
    from what the launch that also writes x reads (lora_fold.py). ``SIGNAL`` (the one-launch ticketed kernel,
    lora_ticketed.py): after its partial is stored, the program adds 1 to ``done_ptr[chunk * num_slices + sl]``
    (release, GPU scope), so an expand program of that (chunk, slice) can wait for all of them in the same launch."""
    num_chunks = tl.load(num_chunks_ptr)
    k_tiles = tl.cdiv(K, BLOCK_K)
    parts, tiles_per = split_parts(progs, num_chunks, SPLIT_K, k_tiles)
    chunk = pid // parts
    part = pid % parts
    if chunk >= num_chunks:
        return
    offs_m = tl.arange(0, BLOCK_M)
    r0 = r_tile * BLOCK_R
    if CHUNK_TABLES:
        # slot, rank and tokens all indexed by the chunk: one round trip, not three in a row
        slot = tl.load(chunk_slots_ptr + chunk)
        rank = tl.load(chunk_ranks_ptr + sl * stride_crs + chunk)
        tok = tl.load(chunk_tokens_ptr + chunk * BLOCK_M + offs_m)
        if slot < 0:
            return
        if r0 >= rank:
            return
    else:
        slot = tl.load(chunk_slots_ptr + chunk)
        if slot < 0:
            return
        rank = tl.load(ranks_ptr + sl * stride_rs + slot)
        if r0 >= rank:
            return
        tok = tl.zeros((BLOCK_M,), dtype=tl.int32)
    tok, m_mask = chunk_rows(tok, chunk, offs_m, sorted_ids_ptr, chunk_starts_ptr, chunk_lens_ptr, CHUNK_TABLES)
    offs_r = r0 + tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    offs_k = tl.arange(0, BLOCK_K)
    k_lo = part * tiles_per * BLOCK_K
    k_hi = tl.minimum(k_lo + tiles_per * BLOCK_K, K)
    x_ptrs = x_ptr + tok[:, None] * stride_xt + (k_lo + offs_k)[None, :].to(tl.int64) * stride_xk
    a_base = a_ptr + slot.to(tl.int64) * stride_al + sl.to(tl.int64) * stride_as
    a_ptrs = a_base + offs_r[None, :].to(tl.int64) * stride_ar + (k_lo + offs_k)[:, None].to(tl.int64) * stride_ak
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    if PREFETCH_A == 1:
        # A is the adapter's weights: the first tile is loaded before the wait, then each next one a trip ahead
        a_nxt = tl.load(a_ptrs, mask=((k_lo + offs_k) < k_hi)[:, None] & r_mask[None, :], other=0.0)
    if PREFETCH_A == 2:
        # every line of this program's A share into L2 before the wait; the pipelined loop then reads it from there
        offs_pf = tl.arange(0, BLOCK_K // PF_LINE) * PF_LINE
        pf_rows = a_base + tl.where(r_mask, offs_r, r0)[:, None].to(tl.int64) * stride_ar
        for kk in range(k_lo, k_hi, BLOCK_K):
            l2_prefetch(pf_rows + tl.minimum(kk + offs_pf, k_hi - 1)[None, :].to(tl.int64) * stride_ak)
    if USE_PDL:
        gdc_wait()  # x is written by a kernel before this launch's predecessor; A and the metadata are not
    for kk in range(k_lo, k_hi, BLOCK_K):
        k_mask = (kk + offs_k) < k_hi
        xt = x_tile(x_ptrs, m_mask[:, None] & k_mask[None, :], K * stride_xk, X_MODE)
        if PREFETCH_A == 1:
            at = a_nxt
            a_nxt = tl.load(a_ptrs + BLOCK_K * stride_ak,
                            mask=((kk + BLOCK_K + offs_k) < k_hi)[:, None] & r_mask[None, :], other=0.0)
        else:
            at = tl.load(a_ptrs, mask=k_mask[:, None] & r_mask[None, :], other=0.0)
        acc += tl.dot(xt, at, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        a_ptrs += BLOCK_K * stride_ak
    y_ptrs = (y_ptr + part * stride_yp + sl * stride_ys + tok[:, None] * stride_yt
              + offs_r[None, :] * stride_yr)
    tl.store(y_ptrs, acc, mask=m_mask[:, None] & r_mask[None, :])
    if SIGNAL:
        tl.debug_barrier()  # every thread's part of the partial is stored before the count says so
        tl.atomic_add(done_ptr + chunk * num_slices + sl, 1, sem="release", scope="gpu")


@fast_launch
@triton.jit(do_not_specialize=UNSPECIALIZED)
def _lora_shrink_kernel(
    x_ptr, a_ptr, y_ptr, ranks_ptr,
    sorted_ids_ptr, chunk_slots_ptr, chunk_starts_ptr, chunk_lens_ptr, num_chunks_ptr,
    chunk_tokens_ptr, chunk_ranks_ptr,
    K, progs,
    stride_xt, stride_xk,
    stride_al, stride_as, stride_ar, stride_ak,
    stride_yp, stride_ys, stride_yt, stride_yr,
    stride_rs, stride_crs,
    SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr = False, CHUNK_TABLES: tl.constexpr = False,
    PREFETCH_A: tl.constexpr = 0, PF_LINE: tl.constexpr = 64,
):
    pid = tl.program_id(0)
    r_tile = tl.program_id(1)
    sl = tl.program_id(2)
    if USE_PDL:
        gdc_launch_dependents()
        if (pid == 0) & (r_tile == 0) & (sl == 0):
            gdc_wait()
    shrink_program(pid, r_tile, sl, x_ptr, a_ptr, y_ptr, ranks_ptr,
                   sorted_ids_ptr, chunk_slots_ptr, chunk_starts_ptr, chunk_lens_ptr, num_chunks_ptr,
                   chunk_tokens_ptr, chunk_ranks_ptr, y_ptr,
                   K, progs, 0,
                   stride_xt, stride_xk, stride_al, stride_as, stride_ar, stride_ak,
                   stride_yp, stride_ys, stride_yt, stride_yr, stride_rs, stride_crs,
                   SPLIT_K=SPLIT_K, BLOCK_M=BLOCK_M, BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K, DOT_PRECISION=DOT_PRECISION,
                   USE_PDL=USE_PDL, CHUNK_TABLES=CHUNK_TABLES, PREFETCH_A=PREFETCH_A, PF_LINE=PF_LINE, SIGNAL=False,
                   X_MODE=X_STORED)


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 models (tests, CPU parity) want exact fp32 products, not tf32
    return "ieee" if dtype == torch.float32 else "tf32"


def pdl_supported(device: torch.device) -> bool:
    """Programmatic dependent launch: Hopper or newer, compiled kernels (never the interpreter)."""
    if not PDL_AVAILABLE or device.type != "cuda" or interpreted():
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def lora_shrink(
    x: torch.Tensor,  # [T, K]
    lora_a: torch.Tensor,  # [num_slots, S, R, K]
    ranks: torch.Tensor,  # [S, num_slots] int32
    meta: LoRAKernelMeta,
    *,
    split_k: int = 1,  # most parts per chunk (y holds this many partials)
    progs: int | None = None,  # programs per (rank tile, slice); default split_k * max_chunks
    block_r: int = 16,
    block_k: int = 128,
    y: torch.Tensor | None = None,  # [>=split_k, >=S, T, R] float32 scratch, reused across layers
    num_warps: int = 4,
    num_stages: int = 3,
    pdl: bool = False,
    chunk_ranks: torch.Tensor | None = None,  # [S, max_chunks] int32: rank of each chunk's slot (with
    # meta.chunk_tokens: the per-chunk tables, one metadata round trip per program)
    weight_prefetch: str = "off",  # before the PDL wait: "first" A tile into registers, or the "l2" share into L2
) -> torch.Tensor:  # [split_k, S, T, R] float32 partial sums; the expand needs the same split_k and progs
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
    progs = split_k * meta.max_chunks if progs is None else progs
    grid = (progs, cdiv(max_rank, block_r), num_slices)
    tables = chunk_tables(meta, chunk_ranks, num_slices)
    prefetch, line = weight_prefetch_mode(weight_prefetch, lora_a.dtype, block_k)
    _lora_shrink_kernel[grid](
        x, lora_a, y, ranks,
        meta.sorted_token_ids, meta.chunk_slots, meta.chunk_starts, meta.chunk_lens, num_chunks_of(meta),
        *tables,
        k_dim, progs,
        x.stride(0), x.stride(1),
        lora_a.stride(0), lora_a.stride(1), lora_a.stride(2), lora_a.stride(3),
        y.stride(0), y.stride(1), y.stride(2), y.stride(3),
        ranks.stride(0), tables[1].stride(0),
        SPLIT_K=split_k, BLOCK_M=meta.block_m, BLOCK_R=block_r, BLOCK_K=block_k,
        DOT_PRECISION=dot_precision(x.dtype), USE_PDL=pdl, CHUNK_TABLES=tables[0] is not meta.chunk_slots,
        PREFETCH_A=prefetch, PF_LINE=line, num_warps=num_warps, num_stages=num_stages,
        **({"launch_pdl": True} if pdl else {}),
    )
    return y


def shrink_split(k_dim: int, meta: LoRAKernelMeta, split_k: int, block_k: int, progs: int | None = None) -> dict:
    """What ``lora_expand`` needs to know of a ``lora_shrink`` call (which partials of y are valid)."""
    return {"shrink_progs": split_k * meta.max_chunks if progs is None else progs,
            "k_tiles": cdiv(k_dim, block_k)}


def chunk_tables(meta: LoRAKernelMeta, chunk_ranks: torch.Tensor | None, num_slices: int):
    """(chunk_tokens, chunk_ranks) for the kernels, or two stand-ins (never read) when either is missing."""
    if chunk_ranks is None or meta.chunk_tokens is None:
        return meta.chunk_slots, meta.chunk_slots.view(1, -1)
    assert chunk_ranks.shape == (num_slices, meta.max_chunks) and chunk_ranks.dtype == torch.int32
    assert chunk_ranks.stride(1) == 1 and meta.chunk_tokens.shape == (meta.max_chunks, meta.block_m)
    return meta.chunk_tokens, chunk_ranks


def num_chunks_of(meta: LoRAKernelMeta) -> torch.Tensor:
    """meta.num_chunks, or (metadata built elsewhere) a device scalar saying every chunk may be in use."""
    if meta.num_chunks is not None:
        return meta.num_chunks
    return torch.full((1,), meta.max_chunks, dtype=torch.int32, device=meta.chunk_slots.device)
