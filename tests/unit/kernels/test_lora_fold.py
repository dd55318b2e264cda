"""The down shrink folded into SiLU-and-multiply (``lora_fold.silu_mul_shrink``, interpreter, fp32/fp16): its act is
``silu_mul``'s, bit for bit, and its split-K partials are ``lora_shrink``'s on that act, bit for bit, so the expand
after it cannot tell the difference; mixed adapters, base tokens, ranks of 0, both tile regimes."""

from __future__ import annotations

import importlib
import os

os.environ["TRITON_INTERPRET"] = "1"  # also set by conftest; kept here so this module runs alone

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

from loraplex.kernels import fused_ops, lora_expand, lora_fold, lora_shrink
from loraplex.kernels.fused_ops_ref import silu_mul_ref
from loraplex.kernels.lora_meta import build_lora_meta
from loraplex.kernels.lora_ref import lora_apply_ref
from loraplex.kernels.lora_testing import make_lora_batch

if not isinstance(lora_fold._silu_mul_shrink_kernel, InterpretedFunction):
    for module in (fused_ops, lora_shrink, lora_expand, lora_fold):
        importlib.reload(module)

WIDTH = 40  # I (the down projection's K): not a multiple of the K tile
OUT = 24  # the down projection's output width


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_tokens, mix, block_m, tables", [
    (1, "identical", 16, False), (7, "distinct", 16, True), (45, "zipf", 16, True), (45, "uniform", 64, False)])
def test_fold_equals_silu_mul_then_shrink(num_tokens, mix, block_m, tables, dtype):
    batch = make_lora_batch(num_tokens, WIDTH, (OUT,), num_slots=5, max_rank=32, mix=mix, dtype=dtype,
                            seed=num_tokens)
    slots = batch.token_slots.clone()
    if num_tokens > 1:
        slots[::3] = -1  # base tokens among the adapters'
    batch.ranks[0, 2] = 0  # an adapter that skips down
    gen = torch.Generator().manual_seed(7)
    gate_up = torch.randn(num_tokens, 2 * WIDTH, generator=gen).to(dtype)
    meta = build_lora_meta(slots, 5, block_m)
    chunk_ranks = batch.ranks.index_select(1, meta.chunk_slots.clamp(min=0).long()) if tables else None
    split_k, progs = 4, 3 * meta.max_chunks  # fewer programs than parts x chunks: parts follow the chunks in use
    kw = dict(split_k=split_k, progs=progs, block_r=16, block_k=16, chunk_ranks=chunk_ranks)

    y_fold = torch.zeros(split_k, 1, num_tokens, 32)
    act, _ = lora_fold.silu_mul_shrink(gate_up, batch.lora_a, batch.ranks, meta, y=y_fold, **kw)
    assert torch.equal(act, fused_ops.silu_mul(gate_up))
    torch.testing.assert_close(act, silu_mul_ref(gate_up))  # the twin: within an ulp
    y_plain = torch.zeros_like(y_fold)
    lora_shrink.lora_shrink(act, batch.lora_a, batch.ranks, meta, y=y_plain, **kw)
    assert torch.equal(y_fold, y_plain)
    with_delta = (slots >= 0) & (batch.ranks[0, slots.clamp(min=0).long()] > 0)
    assert bool(y_fold.any()) == bool(with_delta.any())  # the test can fail: some partial is written

    # and the expand after it gives the LoRA delta of act
    out = batch.out.clone()
    split = lora_shrink.shrink_split(WIDTH, meta, split_k, 16, progs)
    lora_expand.lora_expand(y_fold, batch.lora_b, batch.ranks, batch.scaling, batch.slice_loc, OUT, meta, out,
                            block_n=16, **split)
    want = lora_apply_ref(act, batch.out.clone(), batch.lora_a, batch.lora_b, slots, batch.ranks, batch.scaling,
                          [0, OUT])
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=2e-2)
    torch.testing.assert_close(out, want, **tol)


def test_no_chunks_writes_act_only():
    """A step whose tokens are all base tokens (no chunk): act as silu_mul, y untouched."""
    batch = make_lora_batch(5, WIDTH, (OUT,), num_slots=3, max_rank=16)
    slots = torch.full((5,), -1, dtype=torch.int32)
    meta = build_lora_meta(slots, 3, 16)
    gate_up = torch.randn(5, 2 * WIDTH)
    y = torch.full((2, 1, 5, 16), 7.0)
    act, _ = lora_fold.silu_mul_shrink(gate_up, batch.lora_a, batch.ranks, meta, split_k=2, y=y, block_k=16)
    assert torch.equal(act, fused_ops.silu_mul(gate_up))
    assert (y == 7.0).all()
