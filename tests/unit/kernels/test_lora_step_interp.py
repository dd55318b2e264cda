"""The engine's LoRA step on the Triton path (interpreter) equals its reference-twin path, every projection."""

from __future__ import annotations

import importlib
import os

os.environ["TRITON_INTERPRET"] = "1"  # also set by conftest; kept here so this module runs alone

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

from loraplex.adapters.mapping import LoRAStep
from loraplex.adapters.modules import PROJ_MODULES, BaseShapes
from loraplex.adapters.slot_pool import SlotPool
from loraplex.kernels import (
    fused_ops,
    lora_expand,
    lora_fold,
    lora_ops,
    lora_shrink,
    lora_silu_mul,
    lora_ticketed,
)
from loraplex.kernels.fused_ops_ref import silu_mul_ref

if not isinstance(lora_shrink._lora_shrink_kernel, InterpretedFunction) or not isinstance(
        lora_silu_mul._lora_silu_mul_kernel, InterpretedFunction) or not isinstance(
        lora_ticketed._lora_ticketed_kernel, InterpretedFunction) or not isinstance(
        lora_fold._silu_mul_shrink_kernel, InterpretedFunction):
    for module in (fused_ops, lora_shrink, lora_expand, lora_silu_mul, lora_ticketed, lora_fold):
        importlib.reload(module)
    importlib.reload(lora_ops)

SHAPES = BaseShapes(num_layers=2, hidden_size=48, q_size=48, kv_size=16, intermediate_size=80)


def _pool_and_slots(gen: torch.Generator, num_tokens: int, num_active: int) -> tuple[SlotPool, torch.Tensor]:
    """A pool of random adapters (mixed ranks, rank 0 included) and token slots among ``num_active`` and -1."""
    pool = SlotPool(SHAPES, max_loras=4, max_rank=24, device="cpu", dtype=torch.float32)
    for t in (*pool.a.values(), *pool.bt.values()):
        t.copy_(torch.randn(t.shape, generator=gen) * 0.3)
    pool.ranks.copy_(torch.randint(0, 25, pool.ranks.shape, generator=gen, dtype=torch.int32))
    pool.scaling.copy_(torch.rand(4, generator=gen) + 0.5)
    slots = torch.randint(-1, num_active, (num_tokens,), generator=gen, dtype=torch.int32)
    return pool, slots


def _each_add(gen: torch.Generator, num_tokens: int, want_step: LoRAStep, got_step: LoRAStep):
    """(base, want, got) for every projection and layer: both steps' ``add`` on the same random x and base output."""
    for proj in PROJ_MODULES:
        x = torch.randn(num_tokens, SHAPES.proj_in(proj), generator=gen)
        base = torch.randn(num_tokens, sum(SHAPES.slice_widths(proj)), generator=gen)
        for layer in range(SHAPES.num_layers):
            yield base, want_step.add(layer, proj, x, base.clone()), got_step.add(layer, proj, x, base.clone())


@pytest.mark.parametrize("ticketed", [False, True])
@pytest.mark.parametrize("num_tokens, num_active", [(6, 3), (70, 2)])  # decode-like and prefill-like regimes
def test_step_triton_path_equals_twin_path(num_tokens, num_active, ticketed, monkeypatch):
    """``ticketed`` (LORAPLEX_LORA_TICKETED=1): decode steps run each projection's shrink and expand in one launch,
    sharing the step's counters across every launch."""
    monkeypatch.setattr(lora_ops, "TICKETED_DECODE", ticketed)
    gen = torch.Generator().manual_seed(num_tokens)
    pool, slots = _pool_and_slots(gen, num_tokens, num_active)
    twin = LoRAStep(pool, slots, num_active, use_triton=False)
    triton_step = LoRAStep(pool, slots, num_active, use_triton=True)
    assert all(c.ticketed for c in triton_step._configs.values()) == ticketed  # both sizes get the decode tiles
    assert (triton_step._counters is not None) == ticketed
    for base, want, got in _each_add(gen, num_tokens, twin, triton_step):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(got[slots < 0], base[slots < 0])
        assert triton_step._counters is None or not triton_step._counters.any()


@pytest.mark.parametrize("num_tokens, num_active", [(6, 3), (70, 2)])
def test_step_silu_mul_with_the_gate_up_delta_inside(num_tokens, num_active):
    """``fuse_silu_mul``: the step's silu_mul (shrink + lora_silu_mul on the Triton path, twins otherwise) equals
    the unfused twin path, expand into gate|up then SiLU-and-multiply, with base tokens among the adapters'."""
    gen = torch.Generator().manual_seed(100 + num_tokens)
    pool, slots = _pool_and_slots(gen, num_tokens, num_active)
    unfused = LoRAStep(pool, slots, num_active, use_triton=False)
    for use_triton in (False, True):
        step = LoRAStep(pool, slots, num_active, use_triton=use_triton, fuse_silu_mul=True)
        assert step.fuses_silu_mul
        for layer in range(SHAPES.num_layers):
            x = torch.randn(num_tokens, SHAPES.proj_in("gate_up"), generator=gen)
            gate_up = torch.randn(num_tokens, 2 * SHAPES.intermediate_size, generator=gen)
            want = silu_mul_ref(unfused.add(layer, "gate_up", x, gate_up.clone()))
            got = step.silu_mul(layer, x, gate_up.clone())
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not LoRAStep(pool, slots, 0, use_triton=True, fuse_silu_mul=True).fuses_silu_mul  # no adapter: plain


@pytest.mark.parametrize("with_base_tokens", [True, False])
def test_expand_first_linear_equals_gemm_then_expand(with_base_tokens):
    """``expand_first_min_tokens``: a step at least that large runs shrink, write-only expand, then the base GEMM
    accumulating into it (``out.addmm_``); same result as GEMM then the accumulating expand, for every projection,
    ranks mixed (rank-0 slices included), with and without tokens that carry no adapter."""
    gen = torch.Generator().manual_seed(7 + with_base_tokens)
    num_tokens, num_active = 70, 3
    pool, slots = _pool_and_slots(gen, num_tokens, num_active)
    if not with_base_tokens:
        slots = slots.clamp(min=0)
    assert bool((slots < 0).any()) == with_base_tokens and bool((pool.ranks[:, :, :num_active] == 0).any())
    plain = LoRAStep(pool, slots, num_active, use_triton=True)
    first = LoRAStep(pool, slots, num_active, use_triton=True, expand_first_min_tokens=64,
                     has_base_tokens=with_base_tokens)
    assert first.expand_first and not plain.expand_first
    assert not LoRAStep(pool, slots, num_active, use_triton=True, expand_first_min_tokens=71).expand_first
    assert not LoRAStep(pool, slots, num_active, use_triton=False, expand_first_min_tokens=1).expand_first
    for proj in PROJ_MODULES:
        x = torch.randn(num_tokens, SHAPES.proj_in(proj), generator=gen)
        weight = torch.randn(sum(SHAPES.slice_widths(proj)), SHAPES.proj_in(proj), generator=gen) * 0.2
        for layer in range(SHAPES.num_layers):
            want = plain.linear(layer, proj, x, weight)
            got = first.linear(layer, proj, x, weight)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
            if with_base_tokens:
                torch.testing.assert_close(got[slots < 0], x[slots < 0] @ weight.t(), rtol=1e-5, atol=1e-5)
    bias = torch.randn(sum(SHAPES.slice_widths("o")), generator=gen)  # with a bias: the usual order
    x = torch.randn(num_tokens, SHAPES.proj_in("o"), generator=gen)
    weight = torch.randn(sum(SHAPES.slice_widths("o")), SHAPES.proj_in("o"), generator=gen) * 0.2
    torch.testing.assert_close(first.linear(0, "o", x, weight, bias), plain.linear(0, "o", x, weight, bias))


@pytest.mark.parametrize("expand_first", [0, 64])
@pytest.mark.parametrize("num_tokens, num_active", [(6, 3), (70, 2)])
def test_folded_down_shrink_equals_silu_mul_then_linear(num_tokens, num_active, expand_first):
    """``fold_shrink``: SiLU-and-multiply with the down shrink in the same launch (``silu_mul_shrink``), then
    ``linear`` for down (the GEMM and the expand only), in either order of GEMM and expand; same act and output as
    ``silu_mul`` then the usual ``linear``, mixed ranks and base tokens. The fold is planned only where it can run."""
    gen = torch.Generator().manual_seed(500 + num_tokens + expand_first)
    pool, slots = _pool_and_slots(gen, num_tokens, num_active)
    plain = LoRAStep(pool, slots, num_active, use_triton=True, expand_first_min_tokens=expand_first)
    fold = LoRAStep(pool, slots, num_active, use_triton=True, expand_first_min_tokens=expand_first, fold_shrink=True)
    assert fold.folds_down_shrink and not plain.folds_down_shrink
    assert fold.expand_first == (0 < expand_first <= num_tokens)
    assert not LoRAStep(pool, slots, num_active, use_triton=False, fold_shrink=True).folds_down_shrink
    assert not LoRAStep(pool, slots, 0, use_triton=True, fold_shrink=True).folds_down_shrink
    assert not LoRAStep(pool, slots, num_active, use_triton=True, fold_shrink=True,
                        fuse_silu_mul=True).folds_down_shrink
    width = SHAPES.intermediate_size
    for layer in range(SHAPES.num_layers):
        gate_up = torch.randn(num_tokens, 2 * width, generator=gen)
        weight = torch.randn(SHAPES.hidden_size, width, generator=gen) * 0.2
        act = fold.silu_mul_shrink(layer, gate_up)
        with pytest.raises(AssertionError, match="not yet consumed"):
            fold.silu_mul_shrink(layer, gate_up)
        want_act = silu_mul_ref(gate_up)
        torch.testing.assert_close(act, want_act)
        got = fold.linear(layer, "down", act, weight)
        torch.testing.assert_close(got, plain.linear(layer, "down", act, weight), rtol=1e-5, atol=1e-4)
        # the partials were used once: the next down linear of the step runs its own shrink
        torch.testing.assert_close(fold.linear(layer, "down", act, weight), got, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("use_triton", [False, True])
@pytest.mark.parametrize("num_tokens, num_active, gemm_slots", [(6, 3, None), (70, 4, None), (9, 2, 2)])
def test_gemm_shrink_linear_equals_gemm_then_lora(use_triton, num_tokens, num_active, gemm_slots):
    """``gemm_shrink``: with the pool's A rows folded under the base weights (``SlotPool.fold_base_weights``), one
    GEMM gives the base output and every slot's y, then the expand; same result as the base GEMM then the usual
    shrink + expand, every projection, mixed ranks (rank 0 included), base tokens among the adapters'. Rows of the
    pool beyond an adapter's rank hold garbage (they are computed and never read), and the base rows of a token
    without an adapter are the plain GEMM's."""
    gen = torch.Generator().manual_seed(31 + num_tokens + use_triton)
    pool, slots = _pool_and_slots(gen, num_tokens, num_active)
    slots[0] = -1
    assert bool((pool.ranks == 0).any())
    weights = {p: [torch.randn(sum(SHAPES.slice_widths(p)), SHAPES.proj_in(p), generator=gen) * 0.2
                   for _ in range(SHAPES.num_layers)] for p in PROJ_MODULES}
    a_before = {p: pool.a[p].clone() for p in PROJ_MODULES}
    folded = {p: pool.fold_base_weights(p, weights[p]) for p in PROJ_MODULES}
    for p in PROJ_MODULES:  # the pool's A is unchanged, now a view under the base rows
        assert torch.equal(pool.a[p], a_before[p])
        assert pool.a[p].data_ptr() == pool.folded[p][0][0, pool.folded[p][1]:].data_ptr()
        for w, view in zip(weights[p], folded[p]):
            assert torch.equal(view, w)
    plain = LoRAStep(pool, slots, num_active, use_triton=use_triton)
    # gemm_slots: the GEMM cut after the A rows of the first slots (every token's slot below it), the kernels planned
    # for at most that many adapters, as LoRAManager.make_step builds such a step
    step = LoRAStep(pool, slots, num_active, use_triton=use_triton, gemm_shrink=True, gemm_slots=gemm_slots,
                    max_adapters=gemm_slots)
    width = pool.max_loras if gemm_slots is None else gemm_slots
    assert step.gemm_shrink and step.gemm_slots == width and not LoRAStep(pool, slots, 0, use_triton=use_triton, gemm_shrink=True).gemm_shrink
    for proj in PROJ_MODULES:
        x = torch.randn(num_tokens, SHAPES.proj_in(proj), generator=gen)
        for layer in range(SHAPES.num_layers):
            w = folded[proj][layer]
            want = plain.linear(layer, proj, x, w)
            got = step.linear(layer, proj, x, w)
            n = pool.folded[proj][1]  # a view of the (cut) folded GEMM's output
            assert got.stride(0) == n + width * len(PROJ_MODULES[proj]) * pool.max_rank
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
            torch.testing.assert_close(got[slots < 0], x[slots < 0] @ w.t(), rtol=1e-5, atol=1e-5)
            # a weight that is not the folded one (or a bias) takes the usual path
            other = w.clone()
            assert step.linear(layer, proj, x, other).stride(0) == other.shape[0]
    # a fill after folding lands in the folded tensor
    pool.a["o"][:, 1].zero_()
    assert not pool.folded["o"][0][:, pool.folded["o"][1]:].view_as(pool.a["o"])[:, 1].any()
    with pytest.raises(ValueError, match="already folded"):
        pool.fold_base_weights("o", weights["o"])


def test_mixed_step_takes_prefill_tiles_where_most_tokens_are_long_segments(monkeypatch):
    """A step of one-token decodes on distinct adapters plus one long prompt chunk: its mean per adapter says decode
    tiles; told how many of its tokens sit in long requests (``long_tokens``), it takes prefill tiles once it has
    ``PREFILL_TILES_MIN_TOKENS`` tokens (lowered here to this tiny step's size), and either way the result equals the
    twins'."""
    from loraplex.kernels import lora_ops

    gen = torch.Generator().manual_seed(7)
    pool, _ = _pool_and_slots(gen, 1, 1)
    slots = torch.tensor([0, 1, 2] + [3] * 40, dtype=torch.int32)  # 3 decodes, then a 40-token prompt chunk
    assert LoRAStep(pool, slots, 4, use_triton=True, long_tokens=40)._configs["qkv"].block_m == 16  # 43 < the floor
    monkeypatch.setattr(lora_ops, "PREFILL_TILES_MIN_TOKENS", 43)
    by_mean = LoRAStep(pool, slots, 4, use_triton=True)
    by_segments = LoRAStep(pool, slots, 4, use_triton=True, long_tokens=40)
    few_long = LoRAStep(pool, slots, 4, use_triton=True, long_tokens=20)  # under half of the 43 tokens
    assert by_mean._configs["qkv"].block_m == 16 and few_long._configs["qkv"].block_m == 16
    assert all(c.block_m == 64 for c in by_segments._configs.values())
    twin = LoRAStep(pool, slots, 4, use_triton=False)
    for proj in PROJ_MODULES:
        x = torch.randn(43, SHAPES.proj_in(proj), generator=gen)
        base = torch.randn(43, sum(SHAPES.slice_widths(proj)), generator=gen)
        want = twin.add(1, proj, x, base.clone())
        for step in (by_mean, by_segments):
            torch.testing.assert_close(step.add(1, proj, x, base.clone()), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_tokens, num_active, bound", [(6, 3, 3), (12, 2, 3), (70, 2, 2)])
def test_step_planned_for_few_adapters_equals_the_full_plan(num_tokens, num_active, bound):
    """``max_adapters`` (bench lora_plan's plans for at most N adapters): smaller chunk tables and grids, the plan
    for the whole pool's result (up to the fp32 order of other K parts), for any mix within the bound."""
    gen = torch.Generator().manual_seed(100 + num_tokens)
    pool, slots = _pool_and_slots(gen, num_tokens, num_active)
    full = LoRAStep(pool, slots, pool.max_loras, use_triton=True)
    small = LoRAStep(pool, slots, bound, use_triton=True, max_adapters=bound)
    assert small._meta.max_chunks < full._meta.max_chunks
    for _, want, got in _each_add(gen, num_tokens, full, small):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
