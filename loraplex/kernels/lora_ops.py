"""Launch policy for the LoRA kernels: decode (BGMV-like) vs prefill (SGMV-like) regimes, split-K.

Decode steps have about one token per adapter: chunks of 16 tokens (the smallest ``tl.dot`` tile), narrow
rank tiles so small ranks waste nothing, and split-K over the long hidden dimension so the few
(chunk, slice) programs still fill the GPU. Prefill steps have long segments per adapter: chunks of 64
tokens and a rank tile covering the whole rank so x is read once per chunk. The expand splits each slice's
columns so that enough programs run, each looping over several N tiles.

Grids are sized on the host for the worst case (every chunk in use: ``split_k`` shrink programs and
``expand_splits`` expand programs per chunk); the kernels spread them over the chunks actually in use, read
on the device. So a decode CUDA graph captured for distinct adapters serves one adapter's 64 tokens (4
chunks) with the same number of programs: up to ``split_k_max`` K parts per chunk in the shrink, and
columns split ~17x finer in the expand.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

from loraplex.kernels.host_math import cdiv, next_power_of_2
from loraplex.kernels.lora_expand import lora_expand
from loraplex.kernels.lora_fused import lora_fused
from loraplex.kernels.lora_meta import LoRAKernelMeta, max_chunks_for
from loraplex.kernels.lora_shrink import lora_shrink
from loraplex.kernels.lora_silu_mul import lora_silu_mul
from loraplex.kernels.lora_ticketed import lora_ticketed

# Small programs (a few KB to tens of KB each) need many in flight to keep HBM busy: on an H200 (132 SMs)
# the swept optimum of the decode shapes is around 8 programs per SM.
TARGET_PROGRAMS = 1024
MIN_K_PER_SPLIT = 512  # split-K below this leaves each program too few loads to pipeline
LONG_SEGMENT = 32  # tokens per adapter above which a step (or a request's part of it) is prefill-like
# steps of fewer tokens keep the decode tiles whatever their mean per adapter: mixed_step (CUDA graph of the 32 layers'
# LoRA work, Llama-3-8B, rank 16; docs/benchmarks/H200-2026-12-05-run24.md) found decode tiles faster in every mix
# measured up to 3,072 tokens (one 2,048-token prompt on the H200: 4.43 against 5.51 ms; one 512-token prompt on an
# H100: 2.89 against 4.70) and prefill tiles faster for prompts from 3,840 tokens on (H100) and in the 7,535-token
# offline step (H200; one adapter 11.87 against 14.33). In between (H100, run 25): decode tiles won 3 of 4 such mixes
# at 3,328 tokens, prefill tiles won or tied all 4 at 3,584.
PREFILL_TILES_MIN_TOKENS = 3584


@dataclass(frozen=True)
class LoRAKernelConfig:
    block_m: int
    block_r: int  # shrink rank tile
    block_k: int  # shrink K tile
    split_k: int  # shrink programs per chunk when every chunk is in use (grid = split_k * max_chunks)
    block_n: int  # expand N tile
    shrink_warps: int = 4
    shrink_stages: int = 3
    expand_splits: int | None = None  # expand programs per chunk when every chunk is in use; None = one per tile
    expand_warps: int = 4
    expand_stages: int = 3
    split_k_max: int | None = None  # most K parts per chunk (fewer chunks in use: more parts); None = split_k
    pdl: bool = False  # programmatic dependent launch (sm_90+): shrink and expand overlap their neighbours
    prefetch_out: bool = True  # expand loads the next out tile one trip ahead
    # weights (A in the shrink, B in the expand) are never written by the step, so their loads need not wait for
    # the launch before (PDL): "off", the "first" tile into registers, or the program's whole share into "l2"
    weight_prefetch: str = "off"
    chunk_tables: bool = True  # read slot, rank and tokens by chunk (one round trip) when the caller has the tables
    # decode: one fused launch (lora_fused) instead of shrink + expand; fused_split_k > 1 uses the
    # last-arriver counter, else fused_n_splits programs per (chunk, slice) split the columns
    fused: bool = False
    fused_split_k: int = 1
    fused_n_splits: int = 1
    fused_block_k: int = 128
    fused_block_n: int = 128
    fused_warps: int = 4
    fused_stages: int = 3
    # decode: shrink and expand of these tiles in one launch (lora_ticketed: the expand programs wait on per-(chunk,
    # slice) counts), one num_warps for both halves
    ticketed: bool = False
    ticket_warps: int = 4
    ticket_stages: int = 3

    @property
    def parts_max(self) -> int:
        """Rows of the fp32 shrink scratch this configuration writes."""
        return max(self.split_k, self.split_k_max or 1, self.fused_split_k)


def compile_key(cfg: LoRAKernelConfig) -> tuple:
    """The fields of a configuration that reach the kernels as compile-time constants (tiles, K parts, warps,
    switches): two steps with the same key run the same compiled variants. ``split_k`` (grid size: programs per
    chunk) and ``expand_splits`` reach them only as unspecialized integers, so they are left out; the K parts a
    shrink writes (``split_k_max``, else ``split_k``) are a constant and stay."""
    return dataclasses.astuple(dataclasses.replace(cfg, split_k=0, split_k_max=cfg.split_k_max or cfg.split_k,
                                                   expand_splits=None))


# decode: up to this many K parts per chunk when few chunks are in use (one adapter's 64 tokens: 4 chunks), and
# parts of at least two K tiles
DECODE_SPLIT_K_MAX = 32


def long_tokens_of(query_lens) -> int:
    """Tokens of a step in requests of more than ``LONG_SEGMENT`` of them (``query_lens``: one entry per request)."""
    return int(query_lens[query_lens > LONG_SEGMENT].sum())


def choose_config(num_tokens: int, num_active_slots: int, num_slots: int, max_rank: int,
                  k_dim: int, num_slices: int = 3, max_slice_width: int | None = None,
                  pdl: bool = False, regime: str | None = None, long_tokens: int | None = None) -> LoRAKernelConfig:
    """Pick tiles from host-known sizes only (token count, distinct adapters), never device values.

    ``pdl``: the caller's device supports programmatic dependent launch (``lora_shrink.pdl_supported``) and
    the policy wants it (``USE_PDL``). ``regime``: "decode" or "prefill" tiles whatever the mean tokens per adapter
    (None: decode at 32 or fewer, and below ``PREFILL_TILES_MIN_TOKENS`` tokens whatever the mean). ``long_tokens``
    (host-known, None: unknown): the step's tokens in requests with more than ``LONG_SEGMENT`` of them; when they are
    most of a step of ``PREFILL_TILES_MIN_TOKENS`` or more, it gets prefill tiles even if its mean per adapter is
    small (a step admitting prompts while hundreds of others decode on distinct adapters)."""
    if regime not in (None, "decode", "prefill"):
        raise ValueError(f"regime must be decode, prefill or None, got {regime!r}")
    per_adapter = num_tokens / max(1, num_active_slots)
    rank_pow2 = max(16, next_power_of_2(max_rank))
    if regime is None:
        long_step = per_adapter > LONG_SEGMENT or bool(long_tokens and 2 * long_tokens > num_tokens)
        regime = "prefill" if long_step and num_tokens >= PREFILL_TILES_MIN_TOKENS else "decode"
    decode = regime == "decode"
    if decode:
        block_m, block_r, block_k, shrink_warps, max_split = 16, 16, 128, 2, 16
    else:
        # long segments: x is re-read per rank tile, and y traffic grows with split-K
        block_m, block_r, block_k, shrink_warps, max_split = 64, min(64, rank_pow2), 64, 4, 2
    chunks = max_chunks_for(num_tokens, num_slots, block_m)
    active_chunks = max(1, min(chunks, -(-num_tokens // block_m) + num_active_slots))
    programs = active_chunks * num_slices * cdiv(max_rank, block_r)
    split_k = 1
    while (programs * split_k < TARGET_PROGRAMS and k_dim // (split_k * 2) >= MIN_K_PER_SPLIT
           and split_k < max_split):
        split_k *= 2
    split_k_max = split_k
    if decode:
        # fewer chunks in use than planned (few adapters): each gets more K parts, of two K tiles or more (H200,
        # NOTES-lora.md: 16 parts for K = 4096; at 8, one adapter's o / gate|up / down steps were slower)
        k_tiles = cdiv(k_dim, block_k)
        split_k_max = max(split_k, min(DECODE_SPLIT_K_MAX, max(1, next_power_of_2(k_tiles) // 2)))
    block_n = 128
    if decode and max_rank <= 16 and (max_slice_width or 0) >= 8192:
        # very wide slices (gate|up: 14336): half the loop trips per expand program; H200 sweep, rank 16:
        # 29.3 against 31.9 us per layer for 64 distinct adapters, about equal for 8 or 1 (NOTES-lora.md)
        block_n = 256
    expand_splits = None
    if max_slice_width is not None:
        tiles = cdiv(max_slice_width, block_n)
        target = TARGET_PROGRAMS
        if decode and max_rank <= 16:
            # H200 step sweep (CUDA graph, Llama-3-8B, rank 16, NOTES-lora.md): about 512 expand programs,
            # rounded up to a power of two, was fastest for all four projections (o and down -1.7 us per layer
            # each); at rank 64 down lost 8 us per layer with it, so larger ranks keep 1024
            target = 512
            expand_splits = min(tiles, next_power_of_2(cdiv(target, active_chunks * num_slices)))
        else:
            expand_splits = min(tiles, cdiv(target, active_chunks * num_slices))
    fused = {}
    if FUSED_DECODE and decode and max_slice_width is not None:
        fused = fused_decode_policy(active_chunks, num_slices, max_rank, k_dim, max_slice_width)
    elif TICKETED_DECODE and decode and max_slice_width is not None:
        fused = dict(ticketed=True)
    # the out tile one trip ahead: decode only. H200 run E (NOTES-lora.md), prefill 8,192 tokens on 8 adapters, per
    # layer: q|k|v 99.0 -> 94.2 us and o 73.9 -> 72.6 without it, gate|up 307.9 -> 311.2, down 118.1 -> 117.1;
    # decode gate|up (64 distinct adapters) needs it: 35.9 -> 31.9 us (run D)
    return LoRAKernelConfig(block_m=block_m, block_r=block_r, block_k=block_k, split_k=split_k, block_n=block_n,
                            shrink_warps=shrink_warps, expand_splits=expand_splits, split_k_max=split_k_max,
                            pdl=pdl and USE_PDL, prefetch_out=decode, weight_prefetch=WEIGHT_PREFETCH if decode else "off",
                            **fused)


# Slice offsets as a COL_ALIGN hint for the expand (16-byte, cp.async-pipelined B / out accesses instead of
# 2-byte scalars in the sm_90 PTX); on in every H200 run since run 3 of issue 9 (NOTES-lora.md). False restores
# the scalar expand.
VECTORIZE_EXPAND = True

# Programmatic dependent launch for the shrink and the expand where the device supports it (sm_90+): the
# expand's programs are resident and past their metadata loads when the shrink ends, and the shrink starts as
# the base projection's last blocks leave. Each kernel waits (griddepcontrol.wait) before reading what an
# earlier launch wrote.
USE_PDL = os.environ.get("LORAPLEX_LORA_PDL", "1") != "0"  # LORAPLEX_LORA_PDL=0: off (A/B and diagnosis)

# Weights loaded before the PDL wait in decode steps (LoRAKernelConfig.weight_prefetch: off | first | l2). Off: on the
# H200 (2026-12-03, docs/benchmarks/H200-2026-12-03-run15.md) a 64-distinct-adapter decode step's LoRA work took
# 2.51 ms off, 2.98 with the first tile, 3.18 with the share prefetched into L2 (8 adapters: 1.24 / 1.19 / 1.22).
# LORAPLEX_LORA_WEIGHT_PREFETCH picks another (A/B and diagnosis).
WEIGHT_PREFETCH = os.environ.get("LORAPLEX_LORA_WEIGHT_PREFETCH", "off")

# Off: on the H200 (docs/benchmarks/NOTES-lora.md) every fused configuration measured slower than the
# two-launch path for every Llama-3-8B decode projection (rank 16: 25-100% slower per projection in a CUDA
# graph; again on an H100 in run 25 with the vectorized expand: 27-71% slower at rank 16, q|k|v 2% faster at rank 64).
# The kernel stays, tested, for other shapes and for later work.
FUSED_DECODE = False
# Decode steps: each projection's shrink and expand in one launch (lora_ticketed), half the launches of a step. Off: on
# the H200 (run 27, docs/benchmarks/H200-2026-12-06-run27.md) the 64-distinct-adapter step's LoRA work took 3.09 ms
# against 2.39 with the two launches (PDL already overlaps the expand's launch with the shrink; each ticketed program
# pays a contended atomic first). LORAPLEX_LORA_TICKETED=1 turns it on; bench lora_kernels --steps-only measures both.
TICKETED_DECODE = os.environ.get("LORAPLEX_LORA_TICKETED", "0") == "1"
FUSED_TARGET_PROGRAMS = 256  # ~2 per SM: each fused program streams 100+ KB, enough to keep loads in flight


def fused_decode_policy(active_chunks: int, num_slices: int, max_rank: int, k_dim: int,
                        max_slice_width: int) -> dict:
    """One launch per projection for decode. Bytes per (chunk, slice): A = rank*K*2, B = rank*width*2.

    When B dominates (gate|up: width 14336 > K) the columns are split and each program recomputes y from A
    (the n_splits re-reads of A hit L2); when A dominates (down: K 14336 > width) K is split and the last
    arriving program expands. Either way aim at FUSED_TARGET_PROGRAMS programs.
    """
    pairs = max(1, active_chunks * num_slices)
    want = max(1, -(-FUSED_TARGET_PROGRAMS // pairs))
    if k_dim > max_slice_width:
        split_k = 1
        while split_k < want and k_dim // (split_k * 2) >= MIN_K_PER_SPLIT and split_k < 16:
            split_k *= 2
        if split_k > 1:
            return dict(fused=True, fused_split_k=split_k, fused_block_k=128, fused_block_n=128)
    n_splits = max(1, min(want, max_slice_width // 512))
    return dict(fused=True, fused_n_splits=n_splits, fused_block_k=128, fused_block_n=128)


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
    scratch: torch.Tensor | None = None,  # [>=cfg.parts_max, >=S, T, R] float32
    counters: torch.Tensor | None = None,  # int32 zeros: [>= max_chunks * S] (fused split-K), counters_size (ticketed)
    col_align: int = 1,  # slice_col_align(slice offsets), known on the host: vectorized expand when > 1
    chunk_ranks: torch.Tensor | None = None,  # [S, max_chunks] int32: ranks[:, chunk_slots] (LoRAStep builds it)
) -> torch.Tensor:
    """Semantics: ``lora_ref.lora_apply_ref`` (shrink, then expand with the split-K reduce fused in)."""
    assert meta.block_m == cfg.block_m, "metadata was built for another chunk size"
    if cfg.ticketed:
        return lora_ticketed(x, out, lora_a, lora_b, ranks, scaling, slice_loc, max_slice_width, meta,
                             split_k=cfg.split_k_max or cfg.split_k, shrink_progs=cfg.split_k * meta.max_chunks,
                             block_r=cfg.block_r, block_k=cfg.block_k, block_n=cfg.block_n, n_splits=cfg.expand_splits,
                             y=scratch, counters=counters, num_warps=cfg.ticket_warps, num_stages=cfg.ticket_stages,
                             col_align=col_align, pdl=cfg.pdl, prefetch_out=cfg.prefetch_out,
                             chunk_ranks=chunk_ranks if cfg.chunk_tables else None)
    if cfg.fused:
        return lora_fused(x, out, lora_a, lora_b, ranks, scaling, slice_loc, max_slice_width, meta,
                          split_k=cfg.fused_split_k, n_splits=cfg.fused_n_splits, block_k=cfg.fused_block_k,
                          block_n=cfg.fused_block_n, y=scratch, counters=counters, num_warps=cfg.fused_warps,
                          num_stages=cfg.fused_stages, col_align=col_align)
    y, valid = lora_shrink_apply(x, lora_a, ranks, meta, cfg, scratch, chunk_ranks)
    return lora_expand_apply(y, valid, out, lora_b, ranks, scaling, slice_loc, max_slice_width, meta, cfg,
                             col_align, chunk_ranks)


def lora_shrink_apply(x, lora_a, ranks, meta, cfg: LoRAKernelConfig, scratch, chunk_ranks,
                      pdl: bool | None = None) -> tuple[torch.Tensor, dict]:
    """The shrink of ``cfg`` (split-K partials into ``scratch``) and what its consumer needs to know of it (which
    partials are valid: ``shrink_progs``, ``k_tiles``). ``pdl`` overrides ``cfg.pdl`` (a shrink on a forked stream
    launches without it: its predecessor is an event, not the kernel before it)."""
    parts, valid = _shrink_plan(cfg, meta, x.shape[1])
    y = lora_shrink(x, lora_a, ranks, meta, split_k=parts, progs=valid["shrink_progs"], block_r=cfg.block_r,
                    block_k=cfg.block_k, y=scratch, num_warps=cfg.shrink_warps, num_stages=cfg.shrink_stages,
                    pdl=cfg.pdl if pdl is None else pdl, chunk_ranks=chunk_ranks if cfg.chunk_tables else None,
                    weight_prefetch=cfg.weight_prefetch)
    return y, valid


def _shrink_plan(cfg: LoRAKernelConfig, meta, k_dim: int) -> tuple[int, dict]:
    """(K parts the shrink of ``cfg`` writes, what its expand needs to know of them: ``shrink_progs``, ``k_tiles``)."""
    return cfg.split_k_max or cfg.split_k, {"shrink_progs": cfg.split_k * meta.max_chunks,
                                            "k_tiles": cdiv(k_dim, cfg.block_k)}


def lora_silu_mul_shrink_apply(gate_up, lora_a, ranks, meta, cfg: LoRAKernelConfig, scratch,
                               chunk_ranks) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(act, y, valid): SiLU-and-multiply of gate|up and the down projection's shrink of ``cfg`` on it, in one launch
    (``lora_fold.silu_mul_shrink``); y and valid as from ``lora_shrink_apply`` on act."""
    from loraplex.kernels.lora_fold import silu_mul_shrink

    parts, valid = _shrink_plan(cfg, meta, gate_up.shape[1] // 2)
    act, y = silu_mul_shrink(gate_up, lora_a, ranks, meta, split_k=parts, progs=valid["shrink_progs"],
                             block_r=cfg.block_r, block_k=cfg.block_k, y=scratch, num_warps=cfg.shrink_warps,
                             num_stages=cfg.shrink_stages, chunk_ranks=chunk_ranks if cfg.chunk_tables else None)
    return act, y, valid


def lora_expand_apply(y, valid: dict, out, lora_b, ranks, scaling, slice_loc, max_slice_width: int, meta,
                      cfg: LoRAKernelConfig, col_align: int = 1, chunk_ranks=None, accumulate: bool = True,
                      y_slot_stride: int = 0, zero_base: bool = False) -> torch.Tensor:
    """The expand of ``cfg``: out += scaling * y @ B (``accumulate=False``: out = ..., see lora_expand), reading the
    partials ``lora_shrink_apply`` said are valid."""
    return lora_expand(y, lora_b, ranks, scaling, slice_loc, max_slice_width, meta, out, block_n=cfg.block_n,
                       n_splits=cfg.expand_splits, num_warps=cfg.expand_warps, num_stages=cfg.expand_stages,
                       col_align=col_align, **valid, pdl=cfg.pdl, prefetch_out=cfg.prefetch_out and accumulate,
                       chunk_ranks=chunk_ranks if cfg.chunk_tables else None, accumulate=accumulate,
                       weight_prefetch=cfg.weight_prefetch, y_slot_stride=y_slot_stride, zero_base=zero_base)


def lora_silu_mul_apply(
    x: torch.Tensor,  # [T, K], gate|up's input
    gate_up: torch.Tensor,  # [T, 2I], gate|up's base output (not modified)
    lora_a: torch.Tensor,  # [num_slots, 2, R, K]
    lora_b: torch.Tensor,  # [num_slots, R, 2I]
    ranks: torch.Tensor,  # [2, num_slots] int32
    scaling: torch.Tensor,  # [num_slots] float32
    meta: LoRAKernelMeta,
    cfg: LoRAKernelConfig,  # not ``fused`` (lora_fused adds into gate_up itself)
    scratch: torch.Tensor | None = None,
    chunk_ranks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``silu(gate + dg) * (up + du)`` [T, I]: the shrink of ``cfg``, then ``lora_silu_mul`` in place of the expand
    (semantics: ``lora_silu_mul.lora_silu_mul_ref``)."""
    assert meta.block_m == cfg.block_m and not cfg.fused
    y, valid = lora_shrink_apply(x, lora_a, ranks, meta, cfg, scratch, chunk_ranks)
    # the expand's launch: its tile and warps, PDL after the shrink, per-chunk tables, tiles ahead, and as many
    # programs (each of them does gate and up: twice the expand's column splits, one grid row instead of two)
    return lora_silu_mul(gate_up, y, lora_b, ranks, scaling, meta, **valid, block_n=cfg.block_n,
                         n_splits=cfg.expand_splits and 2 * cfg.expand_splits, num_warps=cfg.expand_warps,
                         num_stages=cfg.expand_stages,
                         pdl=cfg.pdl, chunk_ranks=chunk_ranks if cfg.chunk_tables else None,
                         prefetch=cfg.prefetch_out)
