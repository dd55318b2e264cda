"""``lora_fold_shrink_max_tokens`` on CUDA: the down projection's shrink inside the SiLU-and-multiply launch.

The folded launch computes the same act as ``silu_mul`` and the same split-K partials as the shrink on that act, so
the expand after it sees what it would have seen: the results equal the usual path's, eagerly and under CUDA-graph
replay with other adapter mixes than at capture, in fp32 and bf16, and the engine's greedy tokens and logprobs
equal."""

from __future__ import annotations

import pytest
import torch

from loraplex.kernels.lora_testing import capture_cuda_graph, token_slots_for
from tests.gpu.test_cuda_graphs import _compare, generate_with, mixed_requests
from tests.gpu.test_lora_overlap_gpu import PROJS, _setup

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _mlp_chain(step, shapes, weights, x0):
    """Every projection of every layer through ``step.linear`` as the model runs them; SiLU-and-multiply between
    gate|up and down, with the down shrink folded in where the step plans it."""
    from loraplex.kernels.fused_ops import silu_mul

    outs, x = [], x0
    for layer in range(shapes.num_layers):
        for p in PROJS:
            if p == "down":
                inp = step.silu_mul_shrink(layer, x) if step.folds_down_shrink else silu_mul(x)
            else:
                k = shapes.proj_in(p)
                inp = x[:, :k] if x.shape[1] >= k else x.repeat(1, -(-k // x.shape[1]))[:, :k]
            outs.append(inp)
            x = step.linear(layer, p, inp, weights[layer][p])
            outs.append(x)
    return outs


@pytest.mark.parametrize("expand_first", [0, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_folded_down_shrink_equals_the_usual_path_eager_and_under_graph_replay(dtype, expand_first):
    from loraplex.adapters.mapping import LoRAStep

    shapes, pool, weights, x0, slots_buf, num_tokens, slots_n = _setup(dtype)
    active = min(num_tokens, slots_n)
    results = {}

    def step(fold: bool, n_active=active):
        return LoRAStep(pool, slots_buf, n_active, use_triton=True, fold_shrink=fold,
                        expand_first_min_tokens=expand_first)

    def graph_step():
        s = step(True)
        assert s.folds_down_shrink
        results["graph"] = _mlp_chain(s, shapes, weights, x0)

    graph = capture_cuda_graph(graph_step)
    cpu_gen = torch.Generator().manual_seed(5)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    for mix in ("identical", "distinct", "zipf", "skewed"):
        slots_buf.copy_(token_slots_for(mix, num_tokens, slots_n, cpu_gen).cuda())
        graph.replay()
        torch.cuda.synchronize()
        got = [o.clone() for o in results["graph"]]
        eager = _mlp_chain(step(True), shapes, weights, x0)
        usual = _mlp_chain(step(False), shapes, weights, x0)
        exact = 0
        for i, (g, e, u) in enumerate(zip(got, eager, usual)):
            torch.testing.assert_close(e, u, **tol, msg=lambda m, i=i, mix=mix: f"{mix} eager {i}: {m}")
            torch.testing.assert_close(g, u, **tol, msg=lambda m, i=i, mix=mix: f"{mix} graph {i}: {m}")
            exact += bool(torch.equal(e, u))
        # same act, same partials, same expand: expected bit for bit (a compiler may order the silu differently)
        assert exact >= len(usual) - 2 * shapes.num_layers, (mix, exact, len(usual))
        base_only = _mlp_chain(step(False, 0), shapes, weights, x0)
        assert not torch.allclose(base_only[-1], usual[-1], rtol=1e-3, atol=1e-3)  # the delta is really there


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_with_the_folded_down_shrink_matches_the_usual_path(tiny_model, dtype):
    requests = mixed_requests(tiny_model, seed=17)
    _, usual = generate_with(tiny_model, dtype, requests)
    llm, folded = generate_with(tiny_model, dtype, requests, lora_fold_shrink_max_tokens=8192)
    assert llm.engine.runner.lora_manager.fold_shrink_max_tokens == 8192
    assert _compare(usual, folded, dtype) >= (40 * 12 if dtype == "float32" else 0.8 * 40 * 12)
