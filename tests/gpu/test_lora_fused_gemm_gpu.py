"""``lora_fused_gemm_max_tokens`` on CUDA: small steps compute each projection as the LoRA shrink, then one Triton GEMM
adding every row's delta in its epilogue (``kernels/lora_gemm.py``) instead of cuBLAS and an expand.

The base projection is a different GEMM (Triton's, not cuBLAS's) and the output is rounded once instead of twice, so
results are not bit-identical. fp32: equal to the usual path within fp32 noise, eagerly and under CUDA-graph replay
with other adapter mixes than at capture (programmatic dependent launch on where the GPU has it), and the engine's
greedy tokens equal. bf16: at least as close to an fp32 reference as the usual path; at the Llama-3-8B decode shapes
against an fp32 reference."""

from __future__ import annotations

import pytest
import torch

from loraplex.kernels.lora_testing import capture_cuda_graph, random_slot_pool, token_slots_for
from tests.gpu.test_cuda_graphs import _compare, generate_with, mixed_requests
from tests.gpu.test_lora_expand_first_gpu import _upcast
from tests.gpu.test_lora_overlap_gpu import _chain, _setup
from tests.gpu.test_merged_gpu import _errors

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _step(pool, slots_buf, active, **kw):
    from loraplex.adapters.mapping import LoRAStep

    return LoRAStep(pool, slots_buf, active, use_triton=True, **kw)


def test_fused_gemm_fp32_equals_the_usual_path_eager_and_under_graph_replay():
    shapes, pool, weights, x0, slots_buf, num_tokens, slots_n = _setup(torch.float32)
    active = min(num_tokens, slots_n)
    results = {}

    def graph_step():
        step = _step(pool, slots_buf, active, fused_gemm_max_tokens=num_tokens)
        assert set(step._gemm_blocks) == {"qkv", "o", "gate_up", "down"}
        results["graph"] = _chain(step, shapes, weights, x0)

    graph = capture_cuda_graph(graph_step)
    cpu_gen = torch.Generator().manual_seed(3)
    for mix in ("identical", "distinct", "zipf", "skewed"):
        slots = token_slots_for(mix, num_tokens, slots_n, cpu_gen).cuda()
        slots_buf.copy_(slots)
        graph.replay()
        torch.cuda.synchronize()
        got = [o.clone() for o in results["graph"]]
        eager = _chain(_step(pool, slots_buf, active, fused_gemm_max_tokens=num_tokens), shapes, weights, x0)
        usual = _chain(_step(pool, slots_buf, active), shapes, weights, x0)
        for i, (g, e, u) in enumerate(zip(got, eager, usual)):
            torch.testing.assert_close(e, u, rtol=1e-4, atol=1e-4, msg=lambda m, i=i, mix=mix: f"{mix} eager {i}: {m}")
            torch.testing.assert_close(g, u, rtol=1e-4, atol=1e-4, msg=lambda m, i=i, mix=mix: f"{mix} graph {i}: {m}")
        base_only = _chain(_step(pool, slots_buf, 0), shapes, weights, x0)
        assert not torch.allclose(base_only[0], usual[0], rtol=1e-3, atol=1e-3)  # the delta is really there


def test_fused_gemm_bf16_is_as_accurate_as_the_usual_path():
    shapes, pool, weights, x0, slots_buf, num_tokens, slots_n = _setup(torch.bfloat16)
    pool32, w32 = _upcast(pool), [{p: w.float() for p, w in d.items()} for d in weights]
    active = min(num_tokens, slots_n)
    cpu_gen = torch.Generator().manual_seed(4)
    for mix in ("identical", "distinct", "zipf", "skewed"):
        slots_buf.copy_(token_slots_for(mix, num_tokens, slots_n, cpu_gen).cuda())
        ref = _chain(_step(pool32, slots_buf, active), shapes, w32, x0.float())
        usual = _chain(_step(pool, slots_buf, active), shapes, weights, x0)
        fused = _chain(_step(pool, slots_buf, active, fused_gemm_max_tokens=num_tokens), shapes, weights, x0)
        for i, (r, u, f) in enumerate(zip(ref, usual, fused)):
            err_u = (u.float() - r).abs()
            err_f = (f.float() - r).abs()
            assert err_f.mean() <= 1.25 * err_u.mean() + 1e-4, (mix, i, err_f.mean().item(), err_u.mean().item())
            assert err_f.max() <= 2 * err_u.max() + 1e-2, (mix, i, err_f.max().item(), err_u.max().item())


@pytest.mark.parametrize("num_tokens", [64, 200])
def test_llama3_decode_shapes_bf16_against_fp32(num_tokens):
    """The four Llama-3-8B projections (two layers) with their default tiles, 64 distinct rank-16 adapters."""
    from loraplex.adapters.modules import PROJ_MODULES, BaseShapes

    shapes = BaseShapes(num_layers=2, hidden_size=4096, q_size=4096, kv_size=1024, intermediate_size=14336)
    pool, gen = random_slot_pool(shapes, 64, 16, "cuda", torch.bfloat16, std=0.02)
    pool32 = _upcast(pool)
    slots_buf = (torch.arange(num_tokens, device="cuda", dtype=torch.int32) % 64)
    slots_buf[::7] = -1
    for p in PROJ_MODULES:
        n, k = sum(shapes.slice_widths(p)), shapes.proj_in(p)
        w = (torch.randn(n, k, generator=gen, device="cuda") / k ** 0.5).to(torch.bfloat16)
        x = torch.randn(num_tokens, k, generator=gen, device="cuda").to(torch.bfloat16)
        step = _step(pool, slots_buf, 64, fused_gemm_max_tokens=256)
        assert p in step._gemm_blocks
        got = step.linear(1, p, x, w).float()
        ref = _step(pool32, slots_buf, 64).linear(1, p, x.float(), w.float())
        usual = _step(pool, slots_buf, 64).linear(1, p, x, w).float()
        err_f, err_u = (got - ref).abs(), (usual - ref).abs()
        assert err_f.max() <= 2 * err_u.max() + 1e-2, (p, err_f.max().item(), err_u.max().item())
        assert err_f.mean() <= 1.25 * err_u.mean() + 1e-4, (p, err_f.mean().item(), err_u.mean().item())


def test_engine_with_fused_gemm_fp32_matches_the_usual_path(tiny_model, monkeypatch):
    from loraplex.kernels import lora_gemm

    requests = mixed_requests(tiny_model, seed=11)
    _, usual = generate_with(tiny_model, "float32", requests)
    calls = []
    real = lora_gemm.gemm_lora
    monkeypatch.setattr(lora_gemm, "gemm_lora", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    llm, fused = generate_with(tiny_model, "float32", requests, lora_fused_gemm_max_tokens=256)
    assert llm.engine.runner.lora_manager.fused_gemm_max_tokens == 256
    assert calls  # the engine's steps (eager or captured) went through the fused GEMM
    assert _compare(usual, fused, "float32") == 40 * 12


def test_engine_with_fused_gemm_bf16_is_as_accurate_as_the_usual_path(tiny_model):
    requests = mixed_requests(tiny_model, seed=11)
    _, ref = generate_with(tiny_model, "float32", requests)
    _, usual = generate_with(tiny_model, "bfloat16", requests)
    _, fused = generate_with(tiny_model, "bfloat16", requests, lora_fused_gemm_max_tokens=256)
    err_u, err_f = _errors(ref, usual), _errors(ref, fused)
    assert len(err_f) >= 0.5 * 40 * 12 and len(err_u) >= 0.5 * 40 * 12
    mean_u, mean_f = sum(err_u) / len(err_u), sum(err_f) / len(err_f)
    assert mean_f <= 1.5 * mean_u + 0.01, (mean_f, mean_u)
    assert max(err_f) <= 2 * max(err_u) + 0.05, (max(err_f), max(err_u))
