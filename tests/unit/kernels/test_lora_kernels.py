"""Triton LoRA shrink/expand (interpreter, fp32/fp16) against the pure-torch twins in ``lora_ref``."""

from __future__ import annotations

import importlib
import os

os.environ["TRITON_INTERPRET"] = "1"  # also set by conftest; kept here so this module runs alone

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

from loraplex.kernels import lora_expand, lora_ops, lora_shrink
from loraplex.kernels.lora_meta import build_lora_meta
from loraplex.kernels.lora_ops import choose_config, lora_apply
from loraplex.kernels.lora_ref import lora_apply_ref, lora_expand_ref, lora_shrink_ref
from loraplex.kernels.lora_testing import MIXES, make_lora_batch

if not isinstance(lora_shrink._lora_shrink_kernel, InterpretedFunction):
    # another test module imported the kernels before TRITON_INTERPRET was set: rebuild them
    for module in (lora_shrink, lora_expand):
        importlib.reload(module)

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=1e-2, atol=2e-2)}
QKV = (48, 16, 16)  # GQA: q wider than k and v
K_DIM = 40  # not a multiple of 16


def _run_both(batch, *, block_m=16, block_r=16, block_k=32, split_k=1, block_n=32, n_splits=None,
              weight_prefetch="off", prefetch_out=True):
    meta = build_lora_meta(batch.token_slots, batch.lora_a.shape[0], block_m)
    y = lora_shrink.lora_shrink(batch.x, batch.lora_a, batch.ranks, meta, split_k=split_k, block_r=block_r,
                                block_k=block_k, weight_prefetch=weight_prefetch)
    out = batch.out.clone()
    lora_expand.lora_expand(y, batch.lora_b, batch.ranks, batch.scaling, batch.slice_loc,
                            batch.max_slice_width, meta, out, block_n=block_n, n_splits=n_splits,
                            weight_prefetch=weight_prefetch, prefetch_out=prefetch_out,
                            **lora_shrink.shrink_split(batch.x.shape[1], meta, split_k, block_k))
    ref = lora_apply_ref(batch.x, batch.out.clone(), batch.lora_a, batch.lora_b, batch.token_slots,
                         batch.ranks, batch.scaling, batch.slice_loc)
    return y, out, ref


def _check(batch, out, ref):
    base_rows = batch.token_slots < 0
    assert torch.equal(out[base_rows], batch.out[base_rows]), "slot -1 rows must stay bit-identical"
    assert not torch.equal(out[~base_rows], batch.out[~base_rows]) or not (~base_rows).any()
    torch.testing.assert_close(out, ref, **TOL[out.dtype])


@pytest.mark.parametrize("num_tokens", [1, 7, 133])
@pytest.mark.parametrize("mix", MIXES)
def test_mixes_and_token_counts(mix, num_tokens):
    batch = make_lora_batch(num_tokens, K_DIM, QKV, max_rank=16, mix=mix, seed=num_tokens)
    if num_tokens == 1:
        batch.token_slots[0] = 3  # a lone token that does carry an adapter
    _, out, ref = _run_both(batch)
    _check(batch, out, ref)


@pytest.mark.parametrize("max_rank", [8, 16, 32, 64, 12])
def test_ranks(max_rank):
    batch = make_lora_batch(29, K_DIM, QKV, max_rank=max_rank, mix="uniform", seed=max_rank)
    y, out, ref = _run_both(batch, block_r=16 if max_rank <= 16 else 32)
    _check(batch, out, ref)
    # the shrink output matches its twin wherever it is defined (r < rank, adapter tokens)
    y_ref = lora_shrink_ref(batch.x, batch.lora_a, batch.token_slots, batch.ranks)
    rank_of = batch.ranks[:, batch.token_slots.clamp(min=0).long()]  # [S, T]
    valid = (torch.arange(max_rank)[None, None, :] < rank_of[:, :, None]) & (batch.token_slots >= 0)[None, :, None]
    torch.testing.assert_close(y.sum(0)[valid], y_ref[valid], **TOL[torch.float32])


def test_split_k_and_prefill_regime_single_slice():
    batch = make_lora_batch(133, 200, (72,), max_rank=32, mix="skewed", seed=5)
    _, out, ref = _run_both(batch, block_m=64, block_r=32, block_k=32, split_k=4, block_n=64)
    _check(batch, out, ref)


@pytest.mark.parametrize("n_splits", [1, 2, 3])
def test_expand_programs_loop_over_column_tiles(n_splits):
    """Each expand program covers a share of its slice's columns in 16-wide tiles (some shares empty)."""
    batch = make_lora_batch(21, K_DIM, (80, 16, 16), max_rank=16, mix="zipf", seed=n_splits)
    _, out, ref = _run_both(batch, block_n=16, n_splits=n_splits)
    _check(batch, out, ref)


@pytest.mark.parametrize("prefetch_out", [True, False])
@pytest.mark.parametrize("split_k, n_splits", [(1, 1), (2, 3)])
def test_weights_loaded_a_trip_ahead(split_k, n_splits, prefetch_out):
    """weight_prefetch="first" (decode): the first A / B tile is loaded before the (PDL) wait and each next one a
    trip ahead; parts of several K tiles, programs of several column tiles (some shares empty), a K and widths that
    leave partial last tiles: the same result as the plain loops."""
    batch = make_lora_batch(37, 72, (80, 24, 24), max_rank=16, mix="zipf", dtype=torch.float16, seed=split_k)
    assert (batch.token_slots < 0).any() and (batch.ranks == 0).any()
    _, out, ref = _run_both(batch, block_k=16, split_k=split_k, block_n=16, n_splits=n_splits,
                            weight_prefetch="first", prefetch_out=prefetch_out)
    _check(batch, out, ref)
    _, plain, _ = _run_both(batch, block_k=16, split_k=split_k, block_n=16, n_splits=n_splits,
                            prefetch_out=prefetch_out)
    torch.testing.assert_close(out, plain, rtol=0, atol=0)


def test_fp16_gate_up():
    batch = make_lora_batch(40, K_DIM, (56, 56), max_rank=16, mix="zipf", dtype=torch.float16, seed=7)
    _, out, ref = _run_both(batch)
    _check(batch, out, ref)


def test_lora_apply_with_chosen_config_and_all_base_batch():
    batch = make_lora_batch(20, K_DIM, QKV, max_rank=16, mix="distinct", seed=11)
    cfg = choose_config(20, 8, 8, 16, K_DIM, max_slice_width=48)
    meta = build_lora_meta(batch.token_slots, 8, cfg.block_m)
    out = batch.out.clone()
    lora_apply(batch.x, out, batch.lora_a, batch.lora_b, batch.ranks, batch.scaling, batch.slice_loc,
               batch.max_slice_width, meta, cfg)
    ref = lora_apply_ref(batch.x, batch.out.clone(), batch.lora_a, batch.lora_b, batch.token_slots,
                         batch.ranks, batch.scaling, batch.slice_loc)
    _check(batch, out, ref)
    # a step with no adapter at all leaves the base output untouched
    base_only = torch.full_like(batch.token_slots, -1)
    meta = build_lora_meta(base_only, 8, cfg.block_m)
    out = batch.out.clone()
    lora_apply(batch.x, out, batch.lora_a, batch.lora_b, batch.ranks, batch.scaling, batch.slice_loc,
               batch.max_slice_width, meta, cfg)
    assert torch.equal(out, batch.out)


def test_expand_twin_skips_untargeted_slice():
    batch = make_lora_batch(12, K_DIM, QKV, max_rank=8, mix="identical", seed=3)
    slot = int(batch.token_slots[batch.token_slots >= 0][0])
    batch.ranks[1, slot] = 0
    y = lora_shrink_ref(batch.x, batch.lora_a, batch.token_slots, batch.ranks)
    out = lora_expand_ref(y, batch.lora_b, batch.token_slots, batch.ranks, batch.scaling, batch.slice_loc,
                          batch.out.clone())
    rows = batch.token_slots == slot
    assert torch.equal(out[rows, 48:64], batch.out[rows, 48:64])
    assert not torch.equal(out[rows, :48], batch.out[rows, :48])


@pytest.mark.parametrize("widths, align", [((48, 16, 16), 16), ((56, 56), 8), ((72,), 8)])
def test_expand_with_column_alignment_hint(widths, align):
    """The COL_ALIGN hint (vectorized B / out on the GPU) changes nothing in the result; the host helper gives
    the largest power of two dividing every slice offset."""
    loc = [0]
    for w in widths:
        loc.append(loc[-1] + w)
    assert lora_expand.slice_col_align(loc) == align
    batch = make_lora_batch(23, K_DIM, widths, max_rank=16, mix="zipf", seed=len(widths))
    meta = build_lora_meta(batch.token_slots, batch.lora_a.shape[0], 16)
    y = lora_shrink.lora_shrink(batch.x, batch.lora_a, batch.ranks, meta, split_k=2, block_k=32)
    out = batch.out.clone()
    lora_expand.lora_expand(y, batch.lora_b, batch.ranks, batch.scaling, batch.slice_loc, batch.max_slice_width,
                            meta, out, block_n=16, n_splits=2, col_align=align,
                            **lora_shrink.shrink_split(batch.x.shape[1], meta, 2, 32))
    ref = lora_apply_ref(batch.x, batch.out.clone(), batch.lora_a, batch.lora_b, batch.token_slots,
                         batch.ranks, batch.scaling, batch.slice_loc)
    _check(batch, out, ref)


def test_slice_col_align_edges():
    assert lora_expand.slice_col_align([0, 4096, 5120, 6144]) == 16  # capped: 16 elements is enough
    assert lora_expand.slice_col_align([0, 7]) == 1
    assert lora_expand.slice_col_align([0, 12, 24]) == 4


@pytest.mark.parametrize("tables", [True, False])
@pytest.mark.parametrize("mix", ["identical", "skewed", "distinct"])
def test_grid_planned_for_every_chunk_serves_any_mix(mix, tables):
    """As in a decode CUDA graph: the grid is planned on the host for every token on its own adapter; the
    kernels read how many chunks are in use and give each more K parts (up to split_k_max) and finer column
    shares. One adapter's tokens (2 chunks) then run 7 K parts of 2 tiles each; the result is the twin's, with
    the per-chunk tables (slot, rank, tokens read by chunk) or without."""
    from loraplex.kernels.lora_ops import LoRAKernelConfig
    from loraplex.kernels.lora_shrink import lora_shrink as shrink

    num_tokens, k_dim = 24, 200  # 13 K tiles of 16
    batch = make_lora_batch(num_tokens, k_dim, QKV, num_slots=num_tokens, max_rank=16, mix=mix, seed=4)
    batch.token_slots[:3] = num_tokens // 2  # some adapter tokens in every mix (identical: its own slot)
    cfg = LoRAKernelConfig(block_m=16, block_r=16, block_k=16, split_k=2, split_k_max=8, block_n=16, expand_splits=2)
    meta = build_lora_meta(batch.token_slots, num_tokens, cfg.block_m)
    chunk_ranks = batch.ranks.index_select(1, meta.chunk_slots.clamp(min=0)) if tables else None
    out = batch.out.clone()
    lora_apply(batch.x, out, batch.lora_a, batch.lora_b, batch.ranks, batch.scaling, batch.slice_loc,
               batch.max_slice_width, meta, cfg, chunk_ranks=chunk_ranks)
    ref = lora_apply_ref(batch.x, batch.out.clone(), batch.lora_a, batch.lora_b, batch.token_slots,
                         batch.ranks, batch.scaling, batch.slice_loc)
    _check(batch, out, ref)
    # the shrink alone: the parts it writes for the chunks in use sum to the twin's y
    y = torch.full((8, 3, num_tokens, 16), float("nan"))
    shrink(batch.x, batch.lora_a, batch.ranks, meta, split_k=8, progs=2 * meta.max_chunks, block_k=16, y=y,
           chunk_ranks=chunk_ranks)
    chunks = int(meta.num_chunks)
    parts = min(2 * meta.max_chunks // chunks, 8, 13)
    parts = -(-13 // -(-13 // parts))
    if mix == "identical":
        assert chunks <= 2 and parts == 7
    y_ref = lora_shrink_ref(batch.x, batch.lora_a, batch.token_slots, batch.ranks)
    rank_of = batch.ranks[:, batch.token_slots.clamp(min=0).long()]
    valid = (torch.arange(16)[None, None, :] < rank_of[:, :, None]) & (batch.token_slots >= 0)[None, :, None]
    torch.testing.assert_close(y[:parts].sum(0)[valid], y_ref[valid], **TOL[torch.float32])
    assert y[parts:].isnan().all(), "no part beyond the chunk's count is written"


def test_launch_policy_by_regime():
    """Decode plans for distinct adapters (more K parts and finer column shares come from the device at run time,
    up to split_k_max); the measured per-regime choices: gate|up's wide expand tile and the out prefetch in decode
    only; programmatic dependent launch only where the caller's device has it."""
    qkv = choose_config(64, 64, 64, 16, 4096, 3, 4096, pdl=True)
    gate_up = choose_config(64, 64, 64, 16, 4096, 2, 14336)
    down = choose_config(64, 64, 64, 16, 14336, 1, 4096)
    prefill = choose_config(8192, 8, 8, 16, 4096, 3, 4096, pdl=True)
    assert qkv.block_m == 16 and qkv.split_k < qkv.split_k_max == 16 and qkv.pdl and qkv.prefetch_out
    assert qkv.weight_prefetch == down.weight_prefetch == lora_ops.WEIGHT_PREFETCH  # "off" unless set
    assert prefill.weight_prefetch == "off"
    assert gate_up.block_n == 256 and qkv.block_n == 128 and not gate_up.pdl
    assert down.split_k_max == 32 and down.parts_max == 32  # 112 K tiles: parts of >= 2 tiles, at most 32
    assert prefill.block_m == 64 and prefill.split_k_max == prefill.split_k and not prefill.prefetch_out
    assert choose_config(64, 64, 64, 64, 4096, 2, 14336).block_n == 128  # the wide tile was measured at rank 16


@pytest.mark.parametrize("mix", ["distinct", "zipf", "identical"])
@pytest.mark.parametrize("prefetch_out", [True, False])
def test_write_only_expand_writes_every_adapter_row_and_no_base_row(mix, prefetch_out):
    """``accumulate=False`` (the write-first order): out is not read; every row of a token with an adapter gets the
    delta (zeros in the slice its adapter skips), whatever out held; slot -1 rows are not touched. out starts as
    NaN, so a row or column the kernel misses, or a read of out, shows up."""
    batch = make_lora_batch(70, K_DIM, QKV, max_rank=16, mix=mix, seed=11)
    assert (batch.token_slots < 0).any() and (batch.ranks == 0).any()
    meta = build_lora_meta(batch.token_slots, batch.lora_a.shape[0], 16)
    y = lora_shrink.lora_shrink(batch.x, batch.lora_a, batch.ranks, meta, split_k=2, block_r=16, block_k=32)
    out = torch.full_like(batch.out, float("nan"))
    lora_expand.lora_expand(y, batch.lora_b, batch.ranks, batch.scaling, batch.slice_loc, batch.max_slice_width,
                            meta, out, block_n=32, n_splits=2, prefetch_out=prefetch_out, accumulate=False,
                            **lora_shrink.shrink_split(batch.x.shape[1], meta, 2, 32))
    y_ref = lora_shrink_ref(batch.x, batch.lora_a, batch.token_slots, batch.ranks)
    ref = lora_expand_ref(y_ref, batch.lora_b, batch.token_slots, batch.ranks, batch.scaling, batch.slice_loc,
                          torch.full_like(batch.out, float("nan")), accumulate=False)
    rows = batch.token_slots >= 0
    assert torch.isnan(out[~rows]).all(), "slot -1 rows must not be written"
    assert not torch.isnan(out[rows]).any(), "every column of every adapter row must be written"
    torch.testing.assert_close(out[rows], ref[rows], **TOL[out.dtype])
    skipped = (batch.ranks[1, batch.token_slots.clamp(min=0)] == 0) & rows  # rows whose adapter skips slice 1
    if skipped.any():
        assert torch.equal(out[skipped, 48:64], torch.zeros_like(out[skipped, 48:64]))
    # the write-only delta plus the base output equals the accumulating expand
    summed = out.clone()
    summed[rows] += batch.out[rows]
    summed[~rows] = batch.out[~rows]
    _, _, acc_ref = _run_both(batch)
    torch.testing.assert_close(summed, acc_ref, **TOL[out.dtype])


@pytest.mark.parametrize("case", ["zipf", "mostly-base", "all-base", "no-base"])
@pytest.mark.parametrize("n_splits", [1, 2])
def test_write_only_expand_with_zero_base_writes_zeros_in_base_rows(case, n_splits):
    """``zero_base``: the expand's extra programs write zeros in every row of a token without an adapter, so out
    may start as anything (NaN here): every element is written, base rows exactly 0, adapter rows as the twin's.
    Tokens are interleaved (base and adapter rows alternate in memory); 70 tokens in blocks of 16 leave a partial
    block of base rows; ``all-base`` has no chunk at all (base rows from sorted position 0)."""
    gen = torch.Generator().manual_seed(5)
    slots = {"zipf": None,
             "mostly-base": torch.where(torch.rand(70, generator=gen) < 0.8, -1, torch.randint(0, 8, (70,), generator=gen)),
             "all-base": torch.full((70,), -1),
             "no-base": torch.randint(0, 8, (70,), generator=gen)}[case]
    batch = make_lora_batch(70, K_DIM, QKV, max_rank=16, mix="zipf", seed=12, token_slots=slots)
    meta = build_lora_meta(batch.token_slots, batch.lora_a.shape[0], 16)
    y = lora_shrink.lora_shrink(batch.x, batch.lora_a, batch.ranks, meta, split_k=2, block_r=16, block_k=32)
    out = torch.full_like(batch.out, float("nan"))
    lora_expand.lora_expand(y, batch.lora_b, batch.ranks, batch.scaling, batch.slice_loc, batch.max_slice_width,
                            meta, out, block_n=16, n_splits=n_splits, accumulate=False, zero_base=True,
                            **lora_shrink.shrink_split(batch.x.shape[1], meta, 2, 32))
    y_ref = lora_shrink_ref(batch.x, batch.lora_a, batch.token_slots, batch.ranks)
    ref = lora_expand_ref(y_ref, batch.lora_b, batch.token_slots, batch.ranks, batch.scaling, batch.slice_loc,
                          torch.full_like(batch.out, float("nan")), accumulate=False, zero_base=True)
    assert not torch.isnan(out).any(), "every element must be written"
    base = batch.token_slots < 0
    assert torch.equal(out[base], torch.zeros_like(out[base]))
    torch.testing.assert_close(out, ref, **TOL[out.dtype])


def test_zero_base_needs_the_write_only_order():
    batch = make_lora_batch(8, K_DIM, QKV, max_rank=16, seed=1)
    meta = build_lora_meta(batch.token_slots, batch.lora_a.shape[0], 16)
    y = lora_shrink.lora_shrink(batch.x, batch.lora_a, batch.ranks, meta, split_k=1, block_r=16, block_k=32)
    with pytest.raises(AssertionError, match="zero_base needs accumulate=False"):
        lora_expand.lora_expand(y, batch.lora_b, batch.ranks, batch.scaling, batch.slice_loc, batch.max_slice_width,
                                meta, batch.out.clone(), zero_base=True)
