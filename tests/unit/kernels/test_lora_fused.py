"""Fused decode LoRA kernel (one launch: shrink + expand) under the interpreter, against the twins."""

from __future__ import annotations

import importlib
import os

os.environ["TRITON_INTERPRET"] = "1"  # also set by conftest; kept here so this module runs alone

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

from loraplex.kernels import lora_expand, lora_fused, lora_shrink
from loraplex.kernels.lora_meta import build_lora_meta
from loraplex.kernels.lora_ops import choose_config, lora_apply
from loraplex.kernels.lora_ref import lora_apply_ref
from loraplex.kernels.lora_testing import MIXES, make_lora_batch

if not isinstance(lora_fused._lora_fused_kernel, InterpretedFunction):
    for module in (lora_shrink, lora_expand, lora_fused):
        importlib.reload(module)

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=1e-2, atol=2e-2)}
QKV = (48, 16, 16)  # GQA: q wider than k and v
K_DIM = 72  # not a multiple of 16 nor of the K tile


def _fused(batch, **kw):
    meta = build_lora_meta(batch.token_slots, batch.lora_a.shape[0], 16)
    out = batch.out.clone()
    counters = torch.zeros(meta.max_chunks * (len(batch.slice_loc) - 1), dtype=torch.int32)
    lora_fused.lora_fused(batch.x, out, batch.lora_a, batch.lora_b, batch.ranks, batch.scaling, batch.slice_loc,
                          batch.max_slice_width, meta, counters=counters, **kw)
    ref = lora_apply_ref(batch.x, batch.out.clone(), batch.lora_a, batch.lora_b, batch.token_slots,
                         batch.ranks, batch.scaling, batch.slice_loc)
    return out, ref, counters


def _check(batch, out, ref):
    base_rows = batch.token_slots < 0
    assert torch.equal(out[base_rows], batch.out[base_rows]), "slot -1 rows must stay bit-identical"
    assert not torch.equal(out[~base_rows], batch.out[~base_rows])
    torch.testing.assert_close(out, ref, **TOL[out.dtype])


@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize("variant", [dict(n_splits=1), dict(n_splits=3, block_n=16), dict(split_k=3, block_k=16),
                                     dict(n_splits=2, block_n=16, col_align=16)])
def test_fused_matches_twin(mix, variant):
    batch = make_lora_batch(37, K_DIM, QKV, max_rank=16, mix=mix, seed=len(mix))
    batch.token_slots[0] = 2  # at least one adapter token in every mix
    out, ref, counters = _fused(batch, **variant)
    _check(batch, out, ref)
    assert not counters.any(), "the last arriver resets every ticket counter"


@pytest.mark.parametrize("max_rank", [8, 24, 64])
def test_fused_ranks_and_rank0_slice(max_rank):
    """Mixed real ranks below the pool's (padding rows are random: reading them would show), a skipped slice."""
    batch = make_lora_batch(29, K_DIM, QKV, max_rank=max_rank, mix="uniform", seed=max_rank)
    for variant in (dict(n_splits=2, block_n=16), dict(split_k=2, block_k=32)):
        out, ref, _ = _fused(batch, **variant)
        _check(batch, out, ref)


def test_fused_split_k_counters_reused_across_launches():
    """The same counters serve consecutive launches (layers) of one step, as in LoRAStep."""
    batch = make_lora_batch(21, 200, (72,), max_rank=32, mix="zipf", seed=9)
    meta = build_lora_meta(batch.token_slots, batch.lora_a.shape[0], 16)
    counters = torch.zeros(meta.max_chunks, dtype=torch.int32)
    y = torch.empty(4, 1, 21, 32)
    out = batch.out.clone()
    ref = batch.out.clone()
    for _ in range(3):
        lora_fused.lora_fused(batch.x, out, batch.lora_a, batch.lora_b, batch.ranks, batch.scaling,
                              batch.slice_loc, 72, meta, split_k=4, block_k=32, y=y, counters=counters)
        lora_apply_ref(batch.x, ref, batch.lora_a, batch.lora_b, batch.token_slots, batch.ranks, batch.scaling,
                       batch.slice_loc)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_fp16_fused_gate_up():
    batch = make_lora_batch(40, K_DIM, (56, 56), max_rank=16, mix="zipf", dtype=torch.float16, seed=7)
    out, ref, _ = _fused(batch, n_splits=2, block_n=32)
    _check(batch, out, ref)


def test_decode_policy_is_fused_only_when_enabled_and_never_for_prefill(monkeypatch):
    from loraplex.kernels import lora_ops

    assert not choose_config(64, 64, 64, 16, 4096, 3, 4096).fused  # measured slower on the H200: off
    monkeypatch.setattr(lora_ops, "FUSED_DECODE", True)
    decode = choose_config(64, 64, 64, 16, 4096, 3, 4096)
    assert decode.fused and decode.fused_split_k == 1
    down = choose_config(64, 64, 64, 16, 14336, 1, 4096)
    assert down.fused and down.fused_split_k > 1  # A dominates: split K, last arriver expands
    assert not choose_config(8192, 8, 8, 16, 4096, 3, 4096).fused


def test_lora_apply_dispatches_fused_with_chosen_config(monkeypatch):
    from loraplex.kernels import lora_ops

    monkeypatch.setattr(lora_ops, "FUSED_DECODE", True)
    batch = make_lora_batch(20, K_DIM, QKV, max_rank=16, mix="distinct", seed=11)
    cfg = choose_config(20, 8, 8, 16, K_DIM, 3, 48)
    assert cfg.fused
    meta = build_lora_meta(batch.token_slots, 8, cfg.block_m)
    out = batch.out.clone()
    lora_apply(batch.x, out, batch.lora_a, batch.lora_b, batch.ranks, batch.scaling, batch.slice_loc, 48, meta, cfg)
    ref = lora_apply_ref(batch.x, batch.out.clone(), batch.lora_a, batch.lora_b, batch.token_slots, batch.ranks,
                         batch.scaling, batch.slice_loc)
    _check(batch, out, ref)
