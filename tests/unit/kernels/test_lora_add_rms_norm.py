"""The o / down expand folded into the residual add + RMSNorm (``lora_add_rms_norm``, interpreter, fp32/fp16)
against its twin and against the unfused path (expand into x, then add_rms_norm): mixed adapters and ranks, base
tokens, an adapter of rank 0, split-K partials of which only some are valid."""

from __future__ import annotations

import importlib
import os

os.environ["TRITON_INTERPRET"] = "1"  # also set by conftest; kept here so this module runs alone

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

from loraplex.kernels import lora_add_rms_norm, lora_shrink
from loraplex.kernels.fused_ops_ref import add_rms_norm_ref
from loraplex.kernels.lora_meta import build_lora_meta
from loraplex.kernels.lora_ref import lora_expand_ref, lora_shrink_ref
from loraplex.kernels.lora_testing import make_lora_batch

if not isinstance(lora_add_rms_norm._lora_add_rms_norm_kernel, InterpretedFunction):
    for module in (lora_shrink, lora_add_rms_norm):
        importlib.reload(module)

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=1e-2, atol=2e-2)}
WIDTH = 48  # N: not a power of two (the row block is masked)
K_DIM = 40
EPS = 1e-5


def _case(num_tokens: int, mix: str, dtype, seed: int, split_k: int = 2, block_k: int = 16):
    batch = make_lora_batch(num_tokens, K_DIM, (WIDTH,), num_slots=5, max_rank=16, mix=mix, dtype=dtype, seed=seed)
    slots = batch.token_slots.clone()
    if num_tokens > 2:
        slots[::3] = -1  # base tokens among the adapters'
    batch.ranks[0, 2] = 0  # an adapter that does not target this projection
    meta = build_lora_meta(slots, 5, 16)
    scratch = torch.full((4, 1, num_tokens, 16), float("nan"))  # partials past the valid ones must not be read
    y = lora_shrink.lora_shrink(batch.x, batch.lora_a, batch.ranks, meta, split_k=split_k, block_r=16,
                                block_k=block_k, y=scratch)
    gen = torch.Generator().manual_seed(seed + 100)
    residual = torch.randn(num_tokens, WIDTH, generator=gen).to(dtype)
    weight = (1.0 + 0.1 * torch.randn(WIDTH, generator=gen)).to(dtype)
    return batch, slots, meta, y, residual, weight, lora_shrink.shrink_split(K_DIM, meta, split_k, block_k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_tokens, mix", [(1, "identical"), (7, "distinct"), (33, "zipf"), (33, "uniform")])
def test_fused_equals_twin_and_the_unfused_path(num_tokens, mix, dtype):
    batch, slots, meta, y, residual, weight, split = _case(num_tokens, mix, dtype, seed=num_tokens)
    x, res_in = batch.out.clone(), residual.clone()
    out, res_out = lora_add_rms_norm.lora_add_rms_norm(x, residual, weight, EPS, y, batch.lora_b, batch.ranks,
                                                       batch.scaling, meta, **split)
    assert torch.equal(x, batch.out) and torch.equal(residual, res_in), "x and residual are read, never written"
    y_ref = lora_shrink_ref(batch.x, batch.lora_a, slots, batch.ranks)
    want_out, want_res = lora_add_rms_norm.lora_add_rms_norm_ref(batch.out, residual, weight, EPS, y_ref,
                                                                 batch.lora_b, slots, batch.ranks, batch.scaling)
    torch.testing.assert_close(res_out, want_res, **TOL[dtype])
    torch.testing.assert_close(out, want_out, **TOL[dtype])
    # the unfused path: the expand writes x, then the residual add + RMSNorm
    h = lora_expand_ref(y_ref, batch.lora_b, slots, batch.ranks, batch.scaling, [0, WIDTH], batch.out.clone())
    unfused_out, unfused_res = add_rms_norm_ref(h, residual, weight, EPS)
    torch.testing.assert_close(out, unfused_out, **TOL[dtype])
    torch.testing.assert_close(res_out, unfused_res, **TOL[dtype])
    plain = (slots < 0) | (batch.ranks[0, slots.clamp(min=0).long()] == 0)
    base_out, base_res = add_rms_norm_ref(batch.out, residual, weight, EPS)
    assert torch.equal(res_out[plain], base_res[plain]), "rows without a delta are the plain residual add"
    torch.testing.assert_close(out[plain], base_out[plain], **TOL[dtype])
    if (~plain).any():
        assert not torch.allclose(res_out[~plain], base_res[~plain], atol=1e-3)  # the delta counts


def test_only_the_valid_partials_are_summed():
    """One K tile: the shrink writes one partial of the two it could; the other (NaN) must not be read."""
    batch, slots, meta, y, residual, weight, split = _case(9, "distinct", torch.float32, seed=3, split_k=2,
                                                           block_k=64)
    assert split["k_tiles"] == 1 and torch.isnan(y[1]).all()
    out, res_out = lora_add_rms_norm.lora_add_rms_norm(batch.out, residual, weight, EPS, y, batch.lora_b,
                                                       batch.ranks, batch.scaling, meta, **split)
    y_ref = lora_shrink_ref(batch.x, batch.lora_a, slots, batch.ranks)
    want_out, want_res = lora_add_rms_norm.lora_add_rms_norm_ref(batch.out, residual, weight, EPS, y_ref,
                                                                 batch.lora_b, slots, batch.ranks, batch.scaling)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out, want_out, **TOL[torch.float32])
    torch.testing.assert_close(res_out, want_res, **TOL[torch.float32])


def test_rejects_a_projection_of_several_slices():
    batch = make_lora_batch(4, K_DIM, (WIDTH, WIDTH), num_slots=5, max_rank=16, mix="distinct", seed=1)
    meta = build_lora_meta(batch.token_slots, 5, 16)
    y = torch.zeros(1, 2, 4, 16)
    with pytest.raises(AssertionError, match="one slice"):
        lora_add_rms_norm.lora_add_rms_norm(batch.out[:, :WIDTH].contiguous(), batch.out[:, :WIDTH].contiguous(),
                                            torch.ones(WIDTH), EPS, y, batch.lora_b[:, :, :WIDTH].contiguous(),
                                            batch.ranks[:1].contiguous(), batch.scaling, meta)
