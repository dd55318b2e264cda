"""``lora_expand_first_min_tokens`` on CUDA: large steps run each projection's shrink and a write-only expand, then
the base GEMM accumulates into that output (cuBLAS, beta = 1).

The order of the roundings differs from the usual path (GEMM rounded, then the delta added and rounded again;
here the delta rounded, then added inside the GEMM's epilogue), so results are not bit-identical. fp32: equal to
the usual order within fp32 noise, eagerly and under CUDA-graph replay with other adapter mixes than at capture,
and the engine's greedy tokens equal. bf16: at least as close to an fp32 reference as the usual order is (run 13
found a bf16 chain of 8 projections differing by more than an absolute 3e-2, as two roundings can, so a direct
comparison is not the right check)."""

from __future__ import annotations

import pytest
import torch

from loraplex.kernels.lora_testing import capture_cuda_graph, token_slots_for
from tests.gpu.test_cuda_graphs import _compare, generate_with, mixed_requests
from tests.gpu.test_lora_overlap_gpu import _chain, _setup
from tests.gpu.test_merged_gpu import _errors

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _step(pool, slots_buf, active, **kw):
    from loraplex.adapters.mapping import LoRAStep

    return LoRAStep(pool, slots_buf, active, use_triton=True, **kw)


def equals_the_usual_order_eager_and_under_graph_replay(setup, weights, seed: int, flag: str, graph_options: dict,
                                                        eager_options) -> None:
    """A LoRAStep option (``graph_options``; eagerly ``eager_options(slots)``, whose ``flag`` attribute must say it
    is on) against the usual order in fp32, eagerly and under CUDA-graph replay with other adapter mixes than at
    capture: equal within fp32 noise, and the delta really there."""
    shapes, pool, _, x0, slots_buf, num_tokens, slots_n = setup
    active = min(num_tokens, slots_n)
    results = {}

    def graph_step():
        step = _step(pool, slots_buf, active, **graph_options)
        assert getattr(step, flag)
        results["graph"] = _chain(step, shapes, weights, x0)

    graph = capture_cuda_graph(graph_step)
    cpu_gen = torch.Generator().manual_seed(seed)
    for mix in ("identical", "distinct", "zipf", "skewed"):
        slots = token_slots_for(mix, num_tokens, slots_n, cpu_gen).cuda()
        slots_buf.copy_(slots)
        graph.replay()
        torch.cuda.synchronize()
        got = [o.clone() for o in results["graph"]]
        eager = _chain(_step(pool, slots_buf, active, **eager_options(slots)), shapes, weights, x0)
        usual = _chain(_step(pool, slots_buf, active), shapes, weights, x0)
        for i, (g, e, u) in enumerate(zip(got, eager, usual)):
            torch.testing.assert_close(e, u, rtol=1e-4, atol=1e-4, msg=lambda m, i=i, mix=mix: f"{mix} eager {i}: {m}")
            torch.testing.assert_close(g, u, rtol=1e-4, atol=1e-4, msg=lambda m, i=i, mix=mix: f"{mix} graph {i}: {m}")
        base_only = _chain(_step(pool, slots_buf, 0), shapes, weights, x0)
        assert not torch.allclose(base_only[0], usual[0], rtol=1e-3, atol=1e-3)  # the delta is really there


def as_accurate_as_the_usual_order(setup, weights, pool32, w32, seed: int, options) -> None:
    """A LoRAStep option (``options(slots)``) in bf16 against the usual order, both against an fp32 reference
    (``pool32``, ``w32``): at least as accurate, in mean and in max error, for every adapter mix."""
    shapes, pool, _, x0, slots_buf, num_tokens, slots_n = setup
    active = min(num_tokens, slots_n)
    cpu_gen = torch.Generator().manual_seed(seed)
    for mix in ("identical", "distinct", "zipf", "skewed"):
        slots = token_slots_for(mix, num_tokens, slots_n, cpu_gen).cuda()
        slots_buf.copy_(slots)
        ref = _chain(_step(pool32, slots_buf, active), shapes, w32, x0.float())
        usual = _chain(_step(pool, slots_buf, active), shapes, weights, x0)
        other = _chain(_step(pool, slots_buf, active, **options(slots)), shapes, weights, x0)
        for i, (r, u, o) in enumerate(zip(ref, usual, other)):
            err_u = (u.float() - r).abs()
            err_o = (o.float() - r).abs()
            assert err_o.mean() <= 1.25 * err_u.mean() + 1e-4, (mix, i, err_o.mean().item(), err_u.mean().item())
            assert err_o.max() <= 2 * err_u.max() + 1e-2, (mix, i, err_o.max().item(), err_u.max().item())


def _expand_first(slots) -> dict:
    """The write-first order as the engine asks for it: rows without an adapter start at zero when there are some."""
    return {"expand_first_min_tokens": 1, "has_base_tokens": bool((slots < 0).any())}


def test_expand_first_fp32_equals_the_usual_order_eager_and_under_graph_replay():
    setup = _setup(torch.float32)
    # as captured: base rows start at zero (has_base_tokens defaults to True)
    equals_the_usual_order_eager_and_under_graph_replay(setup, setup[2], 3, "expand_first",
                                                        {"expand_first_min_tokens": 1}, _expand_first)


def test_expand_first_bf16_is_as_accurate_as_the_usual_order():
    setup = _setup(torch.bfloat16)
    pool32, w32 = _upcast(setup[1]), [{p: w.float() for p, w in d.items()} for d in setup[2]]
    as_accurate_as_the_usual_order(setup, setup[2], pool32, w32, 4, _expand_first)


def _upcast(pool):
    """A float32 copy of a bf16 slot pool (the same adapters, exactly)."""
    from loraplex.adapters.slot_pool import SlotPool

    up = SlotPool(pool.shapes, pool.max_loras, pool.max_rank, pool.device, torch.float32)
    for name in ("a", "bt"):
        for p, t in getattr(pool, name).items():
            getattr(up, name)[p].copy_(t.float())
    up.ranks.copy_(pool.ranks)
    up.scaling.copy_(pool.scaling)
    return up


def test_engine_with_expand_first_fp32_matches_the_usual_order(tiny_model):
    requests = mixed_requests(tiny_model, seed=11)
    _, usual = generate_with(tiny_model, "float32", requests, lora_expand_first_min_tokens=0)  # never write-first
    llm, first = generate_with(tiny_model, "float32", requests, lora_expand_first_min_tokens=1)
    assert llm.engine.runner.lora_manager.expand_first_min_tokens == 1
    assert _compare(usual, first, "float32") == 40 * 12


def test_engine_with_expand_first_bf16_is_as_accurate_as_the_usual_order(tiny_model):
    requests = mixed_requests(tiny_model, seed=11)
    _, ref = generate_with(tiny_model, "float32", requests)
    _, usual = generate_with(tiny_model, "bfloat16", requests, lora_expand_first_min_tokens=0)
    _, first = generate_with(tiny_model, "bfloat16", requests, lora_expand_first_min_tokens=1)
    err_u, err_f = _errors(ref, usual), _errors(ref, first)
    assert len(err_f) >= 0.5 * 40 * 12 and len(err_u) >= 0.5 * 40 * 12
    mean_u, mean_f = sum(err_u) / len(err_u), sum(err_f) / len(err_f)
    assert mean_f <= 1.5 * mean_u + 0.01, (mean_f, mean_u)
    assert max(err_f) <= 2 * max(err_u) + 0.05, (max(err_f), max(err_u))
