"""``lora_add_rms_norm`` on CUDA at the Llama-3-8B decode shapes of o and down (N = 4,096, rank 16): fp32 against
the twin; bf16 as accurate as the unfused path (the Triton expand, then the residual add + RMSNorm), both against an
fp32 reference; under CUDA-graph replay with another adapter mix in the captured buffers, equal to eager."""

from __future__ import annotations

import pytest
import torch

from loraplex.kernels import fused_ops
from loraplex.kernels.lora_add_rms_norm import lora_add_rms_norm, lora_add_rms_norm_ref
from loraplex.kernels.lora_meta import build_lora_meta
from loraplex.kernels.lora_ops import choose_config, lora_expand_apply, lora_shrink_apply
from loraplex.kernels.lora_ref import lora_shrink_ref
from loraplex.kernels.lora_shrink import pdl_supported
from loraplex.kernels.lora_testing import capture_cuda_graph

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

N, RANK, SLOTS, EPS = 4096, 16, 64, 1e-5


def _setup(k_dim: int, tokens: int, dtype, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.empty(SLOTS, 1, RANK, k_dim, device="cuda").normal_(0, 0.02, generator=gen).to(dtype)
    b = torch.empty(SLOTS, RANK, N, device="cuda").normal_(0, 0.05, generator=gen).to(dtype)
    ranks = torch.randint(1, RANK + 1, (1, SLOTS), device="cuda", generator=gen, dtype=torch.int32)
    ranks[0, 3] = 0
    scaling = torch.rand(SLOTS, device="cuda", generator=gen) + 0.5
    x_in = torch.randn(tokens, k_dim, device="cuda", generator=gen).to(dtype)
    base = torch.randn(tokens, N, device="cuda", generator=gen).to(dtype)
    residual = torch.randn(tokens, N, device="cuda", generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(N, device="cuda", generator=gen)).to(dtype)
    return a, b, ranks, scaling, x_in, base, residual, weight


def _slots(tokens: int, adapters: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    slots = (torch.randperm(SLOTS, generator=gen)[:adapters])[torch.arange(tokens) % adapters]
    slots[::5] = -1  # base tokens
    return slots.to(torch.int32).cuda()


@pytest.mark.parametrize("k_dim", [4096, 14336])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_against_the_twin_and_the_unfused_path(k_dim, dtype):
    tokens = 64
    a, b, ranks, scaling, x_in, base, residual, weight = _setup(k_dim, tokens, dtype, seed=k_dim)
    slots = _slots(tokens, 64, seed=1)
    cfg = choose_config(tokens, 64, SLOTS, RANK, k_dim, 1, N, pdl=pdl_supported(torch.device("cuda")))
    meta = build_lora_meta(slots, SLOTS, cfg.block_m)
    scratch = torch.empty(cfg.parts_max, 1, tokens, RANK, dtype=torch.float32, device="cuda")
    y, valid = lora_shrink_apply(x_in, a, ranks, meta, cfg, scratch, None)
    out, res = lora_add_rms_norm(base, residual, weight, EPS, y, b, ranks, scaling, meta, **valid)
    work = base.clone()
    lora_expand_apply(y, valid, work, b, ranks, scaling, torch.tensor([0, N], dtype=torch.int32, device="cuda"),
                      N, meta, cfg, 16)
    un_out, un_res = fused_ops.add_rms_norm(work, residual, weight, EPS)
    y_ref = lora_shrink_ref(x_in.float(), a.float(), slots, ranks)
    ref_out, ref_res = lora_add_rms_norm_ref(base.float(), residual.float(), weight.float(), EPS, y_ref, b.float(),
                                             slots, ranks, scaling)
    if dtype == torch.float32:
        torch.testing.assert_close(res, ref_res, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
        return
    for got, unfused, ref in ((out, un_out, ref_out), (res, un_res, ref_res)):
        err = (got.float() - ref).abs().max().item()
        err_unfused = (unfused.float() - ref).abs().max().item()
        assert err <= 1.5 * err_unfused + 1e-2, (err, err_unfused)
    plain = slots < 0
    assert torch.equal(res[plain], un_res[plain])


def test_graph_replay_with_another_mix_equals_eager():
    tokens, k_dim = 64, 4096
    a, b, ranks, scaling, x_in, base, residual, weight = _setup(k_dim, tokens, torch.bfloat16, seed=7)
    static = _slots(tokens, 64, seed=2)  # tiles planned for distinct adapters, as the decode graph does
    cfg = choose_config(tokens, 64, SLOTS, RANK, k_dim, 1, N, pdl=pdl_supported(torch.device("cuda")))
    scratch = torch.empty(cfg.parts_max, 1, tokens, RANK, dtype=torch.float32, device="cuda")
    results = {}

    def step():
        meta = build_lora_meta(static, SLOTS, cfg.block_m)
        y, valid = lora_shrink_apply(x_in, a, ranks, meta, cfg, scratch, None)
        results["out"] = lora_add_rms_norm(base, residual, weight, EPS, y, b, ranks, scaling, meta, **valid)

    graph = capture_cuda_graph(step)
    captured = results["out"]  # the graph's outputs (an eager call below binds new tensors)
    for adapters, seed in ((8, 3), (1, 4), (64, 5)):
        static.copy_(_slots(tokens, adapters, seed))
        graph.replay()
        torch.cuda.synchronize()
        got = [t.clone() for t in captured]
        step()
        for g, expect in zip(got, results["out"]):
            assert torch.equal(g, expect), adapters


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_with_the_norm_fold_matches_the_usual_path(tiny_model, dtype, monkeypatch):
    """The engine on CUDA graphs with ``lora_norm_fold_max_tokens``: decode steps fold (their graphs are built with
    it), fp32 the usual path's tokens and logprobs, bf16 the same up to near ties."""
    from loraplex.adapters.mapping import LoRAStep
    from tests.gpu.test_cuda_graphs import _compare, generate_with, mixed_requests

    folded = []
    original = LoRAStep.add_rms_norm

    def recording(self, *args, **kwargs):
        folded.append(self._deferred is not None)
        return original(self, *args, **kwargs)

    requests = mixed_requests(tiny_model, seed=5)
    _, plain = generate_with(tiny_model, dtype, requests)
    monkeypatch.setattr(LoRAStep, "add_rms_norm", recording)
    _, fold = generate_with(tiny_model, dtype, requests, lora_norm_fold_max_tokens=64)
    assert any(folded)
    compared = _compare(plain, fold, dtype)
    assert compared >= (1.0 if dtype == "float32" else 0.8) * 40 * 12
