"""The one-launch ticketed LoRA kernel (shrink programs, then expand programs waiting on per-(chunk, slice) counts)
under the interpreter, against the twin. Programs run one after another there, in ticket order: the counting, the
waits' targets and the counter resets are the compiled kernel's; the GPU tests run the same code concurrently."""

from __future__ import annotations

import importlib
import os

os.environ["TRITON_INTERPRET"] = "1"  # also set by conftest; kept here so this module runs alone

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

from loraplex.kernels import lora_expand, lora_shrink, lora_ticketed
from loraplex.kernels.lora_meta import build_lora_meta
from loraplex.kernels.lora_ref import lora_apply_ref
from loraplex.kernels.lora_testing import MIXES, make_lora_batch

if not isinstance(lora_ticketed._lora_ticketed_kernel, InterpretedFunction):
    for module in (lora_shrink, lora_expand, lora_ticketed):
        importlib.reload(module)

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=1e-2, atol=2e-2)}
QKV = (48, 16, 16)  # GQA: q wider than k and v
K_DIM = 72  # not a multiple of 16 nor of the K tile


def _run(batch, *, chunk_tables=False, counters=None, extra_shrink_progs=None, **kw):
    meta = build_lora_meta(batch.token_slots, batch.lora_a.shape[0], 16)
    if extra_shrink_progs is not None:  # fewer shrink programs than chunks x split_k (at least one per chunk)
        kw["shrink_progs"] = meta.max_chunks + extra_shrink_progs
    num_slices = len(batch.slice_loc) - 1
    if counters is None:
        counters = torch.zeros(lora_ticketed.counters_size(meta.max_chunks, num_slices), dtype=torch.int32)
    chunk_ranks = None
    if chunk_tables:
        chunk_ranks = batch.ranks.index_select(1, meta.chunk_slots.clamp(min=0).long()).contiguous()
    out = batch.out.clone()
    lora_ticketed.lora_ticketed(batch.x, out, batch.lora_a, batch.lora_b, batch.ranks, batch.scaling,
                                batch.slice_loc, batch.max_slice_width, meta, counters=counters,
                                chunk_ranks=chunk_ranks, **kw)
    ref = lora_apply_ref(batch.x, batch.out.clone(), batch.lora_a, batch.lora_b, batch.token_slots,
                         batch.ranks, batch.scaling, batch.slice_loc)
    return out, ref, counters, meta


def _check(batch, out, ref):
    base_rows = batch.token_slots < 0
    assert torch.equal(out[base_rows], batch.out[base_rows]), "slot -1 rows must stay bit-identical"
    assert not torch.equal(out[~base_rows], batch.out[~base_rows])
    torch.testing.assert_close(out, ref, **TOL[out.dtype])


@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize("variant", [
    dict(),  # one K part, one expand program per column tile
    dict(split_k=3, block_k=16, n_splits=2, block_n=16),  # split-K partials, columns split
    dict(split_k=4, extra_shrink_progs=5, block_k=16, block_n=16, col_align=16),  # uneven K parts per chunk
    dict(split_k=2, block_k=32, block_n=32, chunk_tables=True),  # the engine's per-chunk tables
])
def test_ticketed_matches_twin(mix, variant):
    batch = make_lora_batch(37, K_DIM, QKV, max_rank=16, mix=mix, seed=len(mix))
    batch.token_slots[0] = 2  # at least one adapter token in every mix
    out, ref, counters, _ = _run(batch, **variant)
    _check(batch, out, ref)
    assert not counters.any(), "every launch leaves its counters at 0, and no pair was miscounted"


@pytest.mark.parametrize("max_rank", [8, 24, 64])
def test_ticketed_several_rank_tiles_and_rank0_slice(max_rank):
    """Mixed real ranks below the pool's (padding rows are random: reading them would show), a skipped slice, and
    rank tiles of 16: an expand waits for every K part of each of its slot's rank tiles, no more."""
    batch = make_lora_batch(29, K_DIM, QKV, max_rank=max_rank, mix="uniform", seed=max_rank)
    for variant in (dict(block_r=16, split_k=2, block_k=32, n_splits=2, block_n=16),
                    dict(block_r=max(16, 1 << (max_rank - 1).bit_length()), chunk_tables=True)):
        out, ref, counters, _ = _run(batch, **variant)
        _check(batch, out, ref)
        assert not counters.any()


def test_ticketed_fp16():
    batch = make_lora_batch(40, 96, (64, 32), max_rank=16, mix="zipf", seed=5, dtype=torch.float16)
    batch.token_slots[3] = 4
    out, ref, counters, _ = _run(batch, split_k=2, block_k=32, block_n=32, n_splits=2, col_align=16)
    _check(batch, out, ref)
    assert not counters.any()


def test_counters_shared_by_consecutive_launches_of_different_slice_counts():
    """One counters buffer serves every projection of a step (3 slices, then 1, then 3 again), layer after layer,
    as LoRAStep shares it."""
    qkv = make_lora_batch(33, K_DIM, QKV, max_rank=16, mix="zipf", seed=7)
    down = make_lora_batch(33, 120, (40,), max_rank=16, mix="zipf", seed=8, token_slots=qkv.token_slots)
    meta = build_lora_meta(qkv.token_slots, qkv.lora_a.shape[0], 16)
    counters = torch.zeros(lora_ticketed.counters_size(meta.max_chunks, 3), dtype=torch.int32)
    y = torch.empty(4, 3, 33, 16)
    outs = {id(b): b.out.clone() for b in (qkv, down)}
    refs = {id(b): b.out.clone() for b in (qkv, down)}
    for batch in (qkv, down, qkv, down):
        lora_ticketed.lora_ticketed(batch.x, outs[id(batch)], batch.lora_a, batch.lora_b, batch.ranks, batch.scaling,
                                    batch.slice_loc, batch.max_slice_width, meta, split_k=4, block_k=16,
                                    block_n=16, n_splits=3, y=y, counters=counters)
        lora_apply_ref(batch.x, refs[id(batch)], batch.lora_a, batch.lora_b, batch.token_slots, batch.ranks,
                       batch.scaling, batch.slice_loc)
        assert not counters.any()
    for batch in (qkv, down):
        torch.testing.assert_close(outs[id(batch)], refs[id(batch)], rtol=1e-4, atol=1e-4)


def test_a_count_above_the_wait_target_is_tallied():
    """The expand reads the counts it waits on: counts left over (here: planted) put a pair above its target, and
    the kernel tallies that in the miscount entry instead of passing silently. A correct launch never does
    (every test above ends with all counters at 0)."""
    batch = make_lora_batch(37, K_DIM, QKV, max_rank=16, mix="uniform", seed=3)
    meta = build_lora_meta(batch.token_slots, batch.lora_a.shape[0], 16)
    counters = torch.zeros(lora_ticketed.counters_size(meta.max_chunks, 3), dtype=torch.int32)
    counters[: meta.max_chunks * 3] = 1
    _run(batch, counters=counters, split_k=3, block_k=32, block_n=16, n_splits=2)
    assert lora_ticketed.miscounts(counters, meta.max_chunks, 3) > 0


def test_no_tokens_and_no_adapter_tokens():
    batch = make_lora_batch(20, K_DIM, QKV, mix="zipf", seed=1)
    batch.token_slots.fill_(-1)
    out, _, counters, _ = _run(batch, split_k=2, block_k=32)
    assert torch.equal(out, batch.out) and not counters.any()
    empty = make_lora_batch(0, K_DIM, QKV, mix="zipf", seed=1, token_slots=torch.empty(0, dtype=torch.int32))
    out, _, counters, _ = _run(empty)
    assert out.shape == (0, sum(QKV)) and not counters.any()
