"""``lora_expand_first_min_tokens`` on CUDA: large steps run each projection's shrink and a write-only expand, then
the base GEMM accumulates into that output (cuBLAS, beta = 1). Checked against the usual order (GEMM, then the
accumulating expand) on every projection in fp32 and bf16, eagerly and under CUDA-graph replay with other adapter
mixes than at capture; then the engine end to end with the option on for every step against it off."""

from __future__ import annotations

import pytest
import torch

from loraplex.kernels.lora_testing import capture_cuda_graph, token_slots_for
from tests.gpu.test_cuda_graphs import _compare, generate_with, mixed_requests
from tests.gpu.test_lora_overlap_gpu import _chain, _setup

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=3e-2, atol=3e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expand_first_equals_the_usual_order_eager_and_under_graph_replay(dtype):
    from loraplex.adapters.mapping import LoRAStep

    shapes, pool, weights, x0, slots_buf, num_tokens, slots_n = _setup(dtype)
    active = min(num_tokens, slots_n)
    results = {}

    def graph_step():
        step = LoRAStep(pool, slots_buf, active, use_triton=True, expand_first_min_tokens=1)  # zeros: base rows
        assert step.expand_first
        results["graph"] = _chain(step, shapes, weights, x0)

    graph = capture_cuda_graph(graph_step)
    cpu_gen = torch.Generator().manual_seed(3)
    for mix in ("identical", "distinct", "zipf", "skewed"):
        slots = token_slots_for(mix, num_tokens, slots_n, cpu_gen).cuda()
        slots_buf.copy_(slots)
        graph.replay()
        torch.cuda.synchronize()
        got = [o.clone() for o in results["graph"]]
        has_base = bool((slots < 0).any())
        eager = _chain(LoRAStep(pool, slots_buf, active, use_triton=True, expand_first_min_tokens=1,
                                has_base_tokens=has_base), shapes, weights, x0)
        usual = _chain(LoRAStep(pool, slots_buf, active, use_triton=True), shapes, weights, x0)
        torch.cuda.synchronize()
        for i, (g, e, u) in enumerate(zip(got, eager, usual)):
            torch.testing.assert_close(e, u, **TOL[dtype], msg=f"{mix} eager {i}")
            torch.testing.assert_close(g, u, **TOL[dtype], msg=f"{mix} graph {i}")
        base_only = _chain(LoRAStep(pool, slots_buf, 0, use_triton=True), shapes, weights, x0)
        assert not torch.allclose(base_only[0], usual[0], **TOL[dtype])  # the delta is really there


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_with_expand_first_matches_the_usual_order(tiny_model, dtype):
    requests = mixed_requests(tiny_model, seed=11)
    _, usual = generate_with(tiny_model, dtype, requests)
    llm, first = generate_with(tiny_model, dtype, requests, lora_expand_first_min_tokens=1)
    assert llm.engine.runner.lora_manager.expand_first_min_tokens == 1
    compared = _compare(usual, first, dtype)
    assert compared >= (1.0 if dtype == "float32" else 0.9) * 40 * 12
