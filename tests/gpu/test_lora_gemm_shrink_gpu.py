"""``lora_gemm_shrink`` on CUDA: with every slot's A rows folded under the base weights, one cuBLAS GEMM gives each
projection's base output and every slot's y, then the expand reads each token's own slot's y (bf16: y is rounded by
the GEMM, as the usual expand rounds it before its product, but accumulated in another order).

fp32: equal to the usual order (base GEMM, shrink, expand) within fp32 noise, eagerly and under CUDA-graph replay
with other adapter mixes than at capture. bf16: at least as close to an fp32 reference as the usual order is."""

from __future__ import annotations

import pytest
import torch

from loraplex.kernels.lora_testing import capture_cuda_graph, token_slots_for
from tests.gpu.test_lora_expand_first_gpu import _upcast
from tests.gpu.test_lora_overlap_gpu import PROJS, _chain, _setup

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _step(pool, slots_buf, active, **kw):
    from loraplex.adapters.mapping import LoRAStep

    return LoRAStep(pool, slots_buf, active, use_triton=True, **kw)


def _fold(pool, weights, num_layers):
    """The base weights folded with the pool's A rows; returns the per-layer views the model would use."""
    views = {p: pool.fold_base_weights(p, [weights[i][p] for i in range(num_layers)]) for p in PROJS}
    return [{p: views[p][i] for p in PROJS} for i in range(num_layers)]


def test_gemm_shrink_fp32_equals_the_usual_order_eager_and_under_graph_replay():
    shapes, pool, weights, x0, slots_buf, num_tokens, slots_n = _setup(torch.float32)
    weights = _fold(pool, weights, shapes.num_layers)
    active = min(num_tokens, slots_n)
    results = {}

    def graph_step():
        step = _step(pool, slots_buf, active, gemm_shrink=True)
        assert step.gemm_shrink
        results["graph"] = _chain(step, shapes, weights, x0)

    graph = capture_cuda_graph(graph_step)
    cpu_gen = torch.Generator().manual_seed(5)
    for mix in ("identical", "distinct", "zipf", "skewed"):
        slots = token_slots_for(mix, num_tokens, slots_n, cpu_gen).cuda()
        slots_buf.copy_(slots)
        graph.replay()
        torch.cuda.synchronize()
        got = [o.clone() for o in results["graph"]]
        eager = _chain(_step(pool, slots_buf, active, gemm_shrink=True), shapes, weights, x0)
        usual = _chain(_step(pool, slots_buf, active), shapes, weights, x0)
        for i, (g, e, u) in enumerate(zip(got, eager, usual)):
            torch.testing.assert_close(e, u, rtol=1e-4, atol=1e-4, msg=lambda m, i=i, mix=mix: f"{mix} eager {i}: {m}")
            torch.testing.assert_close(g, u, rtol=1e-4, atol=1e-4, msg=lambda m, i=i, mix=mix: f"{mix} graph {i}: {m}")
        base_only = _chain(_step(pool, slots_buf, 0), shapes, weights, x0)
        assert not torch.allclose(base_only[0], usual[0], rtol=1e-3, atol=1e-3)  # the delta is really there


def test_gemm_shrink_bf16_is_as_accurate_as_the_usual_order():
    shapes, pool, weights, x0, slots_buf, num_tokens, slots_n = _setup(torch.bfloat16)
    pool32, w32 = _upcast(pool), [{p: w.float() for p, w in d.items()} for d in weights]
    weights = _fold(pool, weights, shapes.num_layers)
    active = min(num_tokens, slots_n)
    cpu_gen = torch.Generator().manual_seed(6)
    for mix in ("identical", "distinct", "zipf", "skewed"):
        slots = token_slots_for(mix, num_tokens, slots_n, cpu_gen).cuda()
        slots_buf.copy_(slots)
        ref = _chain(_step(pool32, slots_buf, active), shapes, w32, x0.float())
        usual = _chain(_step(pool, slots_buf, active), shapes, weights, x0)
        gemm = _chain(_step(pool, slots_buf, active, gemm_shrink=True), shapes, weights, x0)
        for i, (r, u, g) in enumerate(zip(ref, usual, gemm)):
            err_u = (u.float() - r).abs()
            err_g = (g.float() - r).abs()
            assert err_g.mean() <= 1.25 * err_u.mean() + 1e-4, (mix, i, err_g.mean().item(), err_u.mean().item())
            assert err_g.max() <= 2 * err_u.max() + 1e-2, (mix, i, err_g.max().item(), err_u.max().item())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_with_gemm_shrink_matches_the_usual_order(tiny_model, dtype):
    """The engine option end to end on CUDA graphs: three adapters on four slots, so decode steps take the in-GEMM
    shrink (their own graph variant); tokens and logprobs as without it (bf16: up to real near-ties)."""
    from loraplex.engine.cuda_graphs import GEMM_SHRINK
    from tests.gpu.test_cuda_graphs import _compare, generate_with, mixed_requests

    requests = mixed_requests(tiny_model, seed=12)
    _, usual = generate_with(tiny_model, dtype, requests)
    llm, got = generate_with(tiny_model, dtype, requests, lora_gemm_shrink=True)
    runner = llm.engine.runner
    assert set(runner.lora_manager.pool.folded) == {"qkv", "o", "gate_up", "down"}
    assert any(key[1] == GEMM_SHRINK for key in runner.graphs.used_keys)
    assert _compare(usual, got, dtype) >= (40 * 12 if dtype == "float32" else 0.5 * 40 * 12)
