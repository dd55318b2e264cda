"""INT8 weight-only linear on CUDA in bf16 (``quantization="int8"``): the compiled kernel against its twin at
Llama-3-8B projection shapes (decode and prefill rows, bias, accumulate), and the engine with CUDA graphs against
the same engine over the dequantized checkpoint."""

from __future__ import annotations

import pytest
import torch

from loraplex.engine.quant import quantize_fp8, quantize_int8
from loraplex.kernels.w8a16 import w8a16_linear, w8a16_linear_ref


@pytest.fixture(scope="module", autouse=True)
def compiled_triton():
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(tl.cdiv, InterpretedFunction):
        pytest.skip("triton was imported with TRITON_INTERPRET=1: run tests/gpu in its own pytest process")


@pytest.mark.parametrize("quantize", [quantize_int8, quantize_fp8], ids=["int8", "fp8"])
@pytest.mark.parametrize("m", [1, 16, 64, 133, 2048])
@pytest.mark.parametrize("n, k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
def test_kernel_matches_twin_bf16(m, n, k, quantize):
    gen = torch.Generator(device="cuda").manual_seed(m + n)
    x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
    w = quantize(torch.randn(n, k, device="cuda", generator=gen) * 0.02)
    bias = torch.randn(n, device="cuda", generator=gen).to(torch.bfloat16)
    got = w8a16_linear(x, w.qweight, w.scale, bias)
    want = w8a16_linear_ref(x, w.qweight, w.scale, bias)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    out = torch.randn(m, n, device="cuda", generator=gen).to(torch.bfloat16)
    base = out.clone()
    w8a16_linear(x, w.qweight, w.scale, out=out, accumulate=True)
    torch.testing.assert_close(out.float(), base.float() + w8a16_linear_ref(x, w.qweight, w.scale).float(),
                               rtol=2e-2, atol=3e-2)


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_engine_int8_equals_dequantized_checkpoint_on_cuda(tiny_model, tmp_path, method):
    from loraplex import LLM, SamplingParams
    from tests.conftest import dequantized_copy

    dequantized_copy(tiny_model["model_dir"], tmp_path, method)
    prompts = [{"prompt_token_ids": [1] + list(range(10, 10 + n))} for n in (3, 30, 120)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    kw = dict(device="cuda", dtype="float32", max_num_batched_tokens=64)
    quant = [o.outputs[0].token_ids for o in LLM(tiny_model["model_dir"], quantization=method, **kw).generate(prompts, params)]
    plain = [o.outputs[0].token_ids for o in LLM(str(tmp_path), **kw).generate(prompts, params)]
    assert quant == plain


@pytest.mark.parametrize("quantize", [quantize_int8, quantize_fp8], ids=["int8", "fp8"])
def test_large_steps_run_the_dequantized_weight_through_cublas(quantize):
    """At ``DEQUANT_GEMM_MIN_ROWS`` rows and more ``quant.linear`` dequantizes into the shared scratch and calls cuBLAS:
    bit-identical to ``F.linear`` over ``dequantize()`` (bias and accumulate too); below it the 8-bit kernel runs."""
    from loraplex.engine import quant

    gen = torch.Generator(device="cuda").manual_seed(5)
    w = quantize(torch.randn(6144, 4096, device="cuda", generator=gen) * 0.02)
    bias = torch.randn(6144, device="cuda", generator=gen).to(torch.bfloat16)
    rows = quant.DEQUANT_GEMM_MIN_ROWS
    x = torch.randn(rows, 4096, device="cuda", generator=gen).to(torch.bfloat16)
    dense = w.dequantize(torch.bfloat16)
    assert torch.equal(quant.linear(x, w, bias), torch.nn.functional.linear(x, dense, bias))
    assert w.scratch is not None and w.scratch.numel() >= dense.numel()
    out = torch.randn(rows, 6144, device="cuda", generator=gen).to(torch.bfloat16)
    want = out.clone().addmm_(x, dense.t())
    assert torch.equal(quant.linear(x, w, out=out, accumulate=True), want)
    small = quant.linear(x[:rows - 1], w, bias)  # the kernel: close, not bit-identical
    torch.testing.assert_close(small.float(), torch.nn.functional.linear(x[:rows - 1], dense, bias).float(),
                               rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_engine_with_every_step_through_the_dequantized_path_equals_the_checkpoint(tiny_model, tmp_path, method,
                                                                                     monkeypatch):
    """Every step at or above the threshold (lowered to 1 row): the engine's tokens and logprobs equal those of the
    engine over the dequantized checkpoint (same weights, same cuBLAS calls); the model shares one scratch buffer."""
    from loraplex import LLM, SamplingParams
    from loraplex.engine import quant
    from tests.conftest import dequantized_copy

    monkeypatch.setattr(quant, "DEQUANT_GEMM_MIN_ROWS", 1)
    dequantized_copy(tiny_model["model_dir"], tmp_path, method)
    prompts = [{"prompt_token_ids": [1] + list(range(10, 10 + n))} for n in (3, 30, 120)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)
    kw = dict(device="cuda", dtype="float32", max_num_batched_tokens=64)
    llm = LLM(tiny_model["model_dir"], quantization=method, **kw)
    layer = llm.engine.runner.model.layers[0]
    assert layer.qkv_weight.scratch is not None and layer.qkv_weight.scratch is layer.down_weight.scratch
    quant_out = llm.generate(prompts, params)
    plain_out = LLM(str(tmp_path), **kw).generate(prompts, params)
    for q, p in zip(quant_out, plain_out):
        assert q.outputs[0].token_ids == p.outputs[0].token_ids
        for lq, lp in zip(q.outputs[0].logprobs, p.outputs[0].logprobs):
            tok = next(iter(lp))
            assert abs(lq[tok].logprob - lp[tok].logprob) < 1e-5
