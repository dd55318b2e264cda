"""The INT8 weight-only linear kernel (interpreter, fp32/fp16) against its twin; its sm_90 build."""

from __future__ import annotations

import importlib
import os

os.environ["TRITON_INTERPRET"] = "1"  # also set by conftest; kept here so this module runs alone

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

from loraplex.engine.quant import QuantizedWeight, linear, quantize_fp8, quantize_int8
from loraplex.kernels import w8a16

if not isinstance(w8a16._w8a16_kernel, InterpretedFunction):
    importlib.reload(w8a16)

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-4), torch.float16: dict(rtol=2e-2, atol=2e-2)}  # K up to 300


@pytest.mark.parametrize("quantize", [quantize_int8, quantize_fp8], ids=["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m, n, k, blocks", [(1, 40, 72, None), (7, 96, 200, None), (70, 33, 50, None),
                                              (130, 65, 129, (64, 64, 64)), (5, 100, 300, (16, 32, 128)),
                                              (9, 70, 300, (16, 32, 64, 4, 2, 3)), (3, 40, 129, (16, 64, 32, 4, 3, 4))])
def test_kernel_matches_twin(m, n, k, blocks, dtype, quantize):
    gen = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = quantize(torch.randn(n, k, generator=gen))
    bias = torch.randn(n, generator=gen).to(dtype)
    for b in (None, bias):
        got = w8a16.w8a16_linear(x, w.qweight, w.scale, b, blocks=blocks)
        torch.testing.assert_close(got, w8a16.w8a16_linear_ref(x, w.qweight, w.scale, b), **TOL[dtype])
    # accumulate: out += x @ W^T, out read then written
    base = torch.randn(m, n, generator=gen).to(dtype)
    out = base.clone()
    w8a16.w8a16_linear(x, w.qweight, w.scale, out=out, accumulate=True, blocks=blocks)
    want = (base.float() + w8a16.w8a16_linear_ref(x.float(), w.qweight, w.scale)).to(dtype)
    torch.testing.assert_close(out, want, **TOL[dtype])


def test_quantize_int8_rows():
    w = torch.tensor([[0.5, -1.0, 0.25], [0.0, 0.0, 0.0], [3.0, 1.5, -0.01]])
    q = quantize_int8(w)
    assert q.qweight.dtype == torch.int8 and q.scale.dtype == torch.float32 and q.shape == (3, 3)
    assert q.qweight[0].tolist() == [64, -127, 32] and q.qweight[1].tolist() == [0, 0, 0]
    assert q.scale[1] == 1.0  # an all-zero row
    err = (q.dequantize(torch.float32) - w).abs()
    assert (err <= q.scale[:, None] / 2 + 1e-7).all()  # half a step at most
    assert q.nbytes() == 9 + 12


def test_quantize_fp8_rows():
    w = torch.tensor([[0.5, -1.0, 0.26], [0.0, 0.0, 0.0], [3.0, 1.5, -0.01]])
    q = quantize_fp8(w)
    assert q.qweight.dtype == torch.float8_e4m3fn and q.scale.dtype == torch.float32
    assert q.qweight.float().abs().amax(dim=1).tolist() == [448.0, 0.0, 448.0]  # each row's largest at full range
    assert q.scale[1] == 1.0
    err = (q.dequantize(torch.float32) - w).abs()
    assert (err <= w.abs() / 16 + 1e-6).all()  # 3 mantissa bits: half a step is 1/16 relative
    assert q.nbytes() == 9 + 12


def test_linear_dispatch_on_the_cpu_is_the_dequantized_weight():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 16, generator=gen)
    w = quantize_int8(torch.randn(8, 16, generator=gen))
    assert isinstance(w, QuantizedWeight)
    assert torch.equal(linear(x, w), torch.nn.functional.linear(x, w.dequantize(torch.float32)))
    out = torch.ones(4, 8)
    linear(x, w, out=out, accumulate=True)
    torch.testing.assert_close(out, 1 + torch.nn.functional.linear(x, w.dequantize(torch.float32)))
    plain = torch.randn(8, 16, generator=gen)
    out2 = torch.zeros(4, 8)
    linear(x, plain, out=out2, accumulate=True)
    torch.testing.assert_close(out2, x @ plain.t())


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA, tests/gpu compiles and runs the kernels for real")
def test_kernel_compiles_for_sm90_in_bf16():
    from tests.unit.kernels.test_lora_compile import _compile_all, job

    shapes = (((16, 32, 128, 1), "*i8"), ((64, 64, 64, 1), "*i8"), ((16, 32, 128, 1), "*fp8e4nv"), ((16, 64, 256, 4), "*i8"))
    built = _compile_all(*[job("w8a16._w8a16_kernel", {"x_ptr": "*bf16", "w_ptr": w_type, "scale_ptr": "*fp32",
                                                       "bias_ptr": "*bf16", "out_ptr": "*bf16"},
                               dict(BLOCK_M=m_block, BLOCK_N=n_block, BLOCK_K=k_block, HAS_BIAS=True,
                                    ACCUMULATE=accumulate, DOT_PRECISION="tf32", SPLIT_K=split_k),
                               runtime_hints=True, num_warps=4, num_stages=3)
                           for (m_block, n_block, k_block, split_k), w_type in shapes for accumulate in (False, True)])
    assert len(built) == 2 * len(shapes)
    for info in built:
        assert info["cubin"]
        assert "cp.async" in info["ptx"]  # the int8 and bf16 tiles are pipelined
