"""The offline bench's Triton compile counter on CUDA: a kernel run at a new specialization adds a compiled
variant, the same call again adds none (so a rise inside a timed window means compiles were timed).

The kernel is this module's own, so no other test can have compiled its variants first."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@triton.jit
def _scale_kernel(x_ptr, n, SCALE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=mask) * SCALE, mask=mask)


def _run(x: torch.Tensor, scale: float) -> None:
    _scale_kernel[(triton.cdiv(x.numel(), 128),)](x, x.numel(), SCALE=scale, BLOCK=128)
    torch.cuda.synchronize()


def test_compile_counter_rises_once_per_new_variant():
    from loraplex.bench.instrument import triton_compiled_kernels

    assert triton_compiled_kernels() >= 0  # our kernels' caches are where the counter looks
    x = torch.ones(1000, device="cuda")
    before = triton_compiled_kernels(__name__)
    assert before == 0
    _run(x, 2.0)
    assert triton_compiled_kernels(__name__) == 1
    _run(x, 2.0)  # same specialization: no compile
    assert triton_compiled_kernels(__name__) == 1
    _run(x, 3.0)  # a new constexpr: one more variant
    assert triton_compiled_kernels(__name__) == 2
    assert torch.equal(x, torch.full_like(x, 12.0))
