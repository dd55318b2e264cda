"""The gate|up expand folded into SiLU-and-multiply (``lora_silu_mul``, interpreter, fp32/fp16) against its twin
and against the unfused path (expand into gate|up, then silu_mul): mixed adapters, base tokens, ranks of 0."""

from __future__ import annotations

import importlib
import os

os.environ["TRITON_INTERPRET"] = "1"  # also set by conftest; kept here so this module runs alone

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

from loraplex.kernels import lora_expand, lora_shrink, lora_silu_mul
from loraplex.kernels.fused_ops_ref import silu_mul_ref
from loraplex.kernels.lora_meta import build_lora_meta
from loraplex.kernels.lora_ref import lora_expand_ref, lora_shrink_ref
from loraplex.kernels.lora_testing import make_lora_batch

if not isinstance(lora_silu_mul._lora_silu_mul_kernel, InterpretedFunction):
    for module in (lora_shrink, lora_expand, lora_silu_mul):
        importlib.reload(module)

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=1e-2, atol=2e-2)}
WIDTH = 40  # I: not a multiple of the column tile
K_DIM = 40


@pytest.mark.parametrize("launch", ["plain", "engine"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_tokens, mix", [(1, "identical"), (7, "distinct"), (45, "zipf"), (45, "uniform")])
def test_fused_equals_twin_and_the_unfused_path(num_tokens, mix, dtype, launch):
    """``launch="engine"``: the options the engine passes (``lora_ops.lora_silu_mul_apply``): per-chunk tables, gate
    and up one tile ahead, two column splits per chunk (a program past I exits)."""
    batch = make_lora_batch(num_tokens, K_DIM, (WIDTH, WIDTH), num_slots=5, max_rank=16, mix=mix, dtype=dtype,
                            seed=num_tokens)
    slots = batch.token_slots.clone()
    if num_tokens > 1:
        slots[::3] = -1  # base tokens among the adapters' (the base programs compute them)
    batch.ranks[0, 2] = 0  # an adapter that skips gate: its up still gets the delta
    meta = build_lora_meta(slots, 5, 16)
    y = lora_shrink.lora_shrink(batch.x, batch.lora_a, batch.ranks, meta, split_k=2, block_r=16, block_k=16)
    gate_up = batch.out.clone()
    split = lora_shrink.shrink_split(K_DIM, meta, 2, 16)
    options = {}
    if launch == "engine":
        chunk_ranks = batch.ranks.index_select(1, meta.chunk_slots.clamp(min=0).long())
        options = dict(chunk_ranks=chunk_ranks, prefetch=True, n_splits=2)
    act = lora_silu_mul.lora_silu_mul(gate_up, y, batch.lora_b, batch.ranks, batch.scaling, meta, block_n=32,
                                      base_block_m=8, **split, **options)
    assert torch.equal(gate_up, batch.out), "gate_up is read, never written"
    y_ref = lora_shrink_ref(batch.x, batch.lora_a, slots, batch.ranks)
    want = lora_silu_mul.lora_silu_mul_ref(batch.out, y_ref, batch.lora_b, slots, batch.ranks, batch.scaling)
    torch.testing.assert_close(act, want, **TOL[dtype])
    # the unfused path: the expand writes gate|up, then silu_mul
    unfused = lora_expand_ref(y_ref, batch.lora_b, slots, batch.ranks, batch.scaling, [0, WIDTH, 2 * WIDTH],
                              batch.out.clone())
    torch.testing.assert_close(act, silu_mul_ref(unfused), **TOL[dtype])
    base = slots < 0
    torch.testing.assert_close(act[base], silu_mul_ref(batch.out[base]), **TOL[dtype])
    if (~base).any():
        assert not torch.allclose(act[~base], silu_mul_ref(batch.out[~base]), atol=1e-3)  # the delta counts


def test_one_kernel_serves_any_adapter_mix_of_a_token_count():
    """As the expand: the grid depends on T only, so one launch configuration works for any mix (graphs)."""
    for seed, mix in enumerate(("distinct", "identical")):
        batch = make_lora_batch(16, K_DIM, (WIDTH, WIDTH), num_slots=5, max_rank=8, mix=mix, seed=seed)
        meta = build_lora_meta(batch.token_slots, 5, 16)
        y = lora_shrink.lora_shrink(batch.x, batch.lora_a, batch.ranks, meta, split_k=1, block_r=16, block_k=32)
        act = lora_silu_mul.lora_silu_mul(batch.out, y, batch.lora_b, batch.ranks, batch.scaling, meta,
                                          **lora_shrink.shrink_split(K_DIM, meta, 1, 32))
        y_ref = lora_shrink_ref(batch.x, batch.lora_a, batch.token_slots, batch.ranks)
        want = lora_silu_mul.lora_silu_mul_ref(batch.out, y_ref, batch.lora_b, batch.token_slots, batch.ranks,
                                               batch.scaling)
        torch.testing.assert_close(act, want, **TOL[torch.float32])
