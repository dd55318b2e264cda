"""The fast launch path (loraplex/kernels/launch.py) on real kernels: once a specialization has compiled, launches
skip Triton's binding and must compute exactly what Triton's own path computes, including after a change of
pointer alignment or integer class (which must compile another variant, not reuse the first), and under CUDA-graph
capture. (Every other GPU test runs the engine's kernels through this path as well.)"""

from __future__ import annotations

import pytest
import torch

from loraplex.kernels import fused_ops
from loraplex.kernels.fused_ops_ref import add_rms_norm_ref
from loraplex.kernels.launch import ENABLED, FastLaunchKernel

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.skipif(not ENABLED, reason="fast launch is off (LORAPLEX_FAST_LAUNCH=1 turns it on)")]


def _triton_path(x, residual, weight, eps):
    """The same launch as fused_ops.add_rms_norm, through Triton's own JITFunction path."""
    kernel = fused_ops._rms_norm_kernel
    assert isinstance(kernel, FastLaunchKernel)
    out, res_out = torch.empty_like(x), torch.empty_like(x)
    n_rows, n_cols = x.shape
    kernel.jit_fn[(n_rows,)](x, residual, weight, out, res_out, x.stride(0), residual.stride(0), out.stride(0),
                             res_out.stride(0), n_cols, eps, HAS_RESIDUAL=True, BLOCK=fused_ops.triton.next_power_of_2(n_cols),
                             num_warps=fused_ops._warps(n_cols))
    return out, res_out


def _misaligned(shape, dtype, gen):
    """A contiguous tensor whose data starts 2 bytes past a 16-byte boundary."""
    flat = torch.randn(shape[0] * shape[1] + 1, device="cuda", generator=gen).to(dtype)
    return flat[1:].view(*shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fast_launches_equal_tritons_path(dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    kernel = fused_ops._rms_norm_kernel
    weight = torch.randn(4096, device="cuda", generator=gen).to(dtype)
    before = kernel.fast_launches
    for rows in (7, 16, 33, 33, 1, 1, 64):  # row counts of other classes (1, divisible by 16) and repeats
        x = torch.randn(rows, 4096, device="cuda", generator=gen).to(dtype)
        r = torch.randn(rows, 4096, device="cuda", generator=gen).to(dtype)
        fast = fused_ops.add_rms_norm(x, r, weight, 1e-5)
        slow = _triton_path(x, r, weight, 1e-5)
        assert torch.equal(fast[0], slow[0]) and torch.equal(fast[1], slow[1])
        ref = add_rms_norm_ref(x, r, weight, 1e-5)
        torch.testing.assert_close(fast[0], ref[0], atol=2e-2 if dtype == torch.bfloat16 else 1e-5, rtol=1e-2)
    assert kernel.fast_launches > before  # the repeats went the fast way


def test_misaligned_inputs_get_their_own_variant():
    gen = torch.Generator(device="cuda").manual_seed(1)
    weight = torch.randn(4096, device="cuda", generator=gen).to(torch.bfloat16)
    for _ in range(3):  # aligned first (compiled with 16-byte pointer hints), then misaligned, alternating
        x = torch.randn(8, 4096, device="cuda", generator=gen).to(torch.bfloat16)
        r = torch.randn(8, 4096, device="cuda", generator=gen).to(torch.bfloat16)
        xm, rm = _misaligned((8, 4096), torch.bfloat16, gen), _misaligned((8, 4096), torch.bfloat16, gen)
        assert xm.data_ptr() % 16 == 2
        for a, b in ((x, r), (xm, rm), (x, rm)):
            fast = fused_ops.add_rms_norm(a, b, weight, 1e-6)
            slow = _triton_path(a, b, weight, 1e-6)
            assert torch.equal(fast[0], slow[0]) and torch.equal(fast[1], slow[1])


def test_fast_launches_under_cuda_graph_capture():
    gen = torch.Generator(device="cuda").manual_seed(2)
    weight = torch.randn(4096, device="cuda", generator=gen).to(torch.bfloat16)
    x = torch.randn(24, 4096, device="cuda", generator=gen).to(torch.bfloat16)
    r = torch.randn(24, 4096, device="cuda", generator=gen).to(torch.bfloat16)
    fused_ops.add_rms_norm(x, r, weight, 1e-6)  # compiled: the capture's launch is a fast one
    before = fused_ops._rms_norm_kernel.fast_launches
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        out, res = fused_ops.add_rms_norm(x, r, weight, 1e-6)
    assert fused_ops._rms_norm_kernel.fast_launches == before + 1
    for _ in range(2):
        x.copy_(torch.randn(24, 4096, device="cuda", generator=gen))
        graph.replay()
        torch.cuda.synchronize()
        slow = _triton_path(x, r, weight, 1e-6)
        assert torch.equal(out, slow[0]) and torch.equal(res, slow[1])
