"""The offline bench's Triton compile counter on CUDA: a kernel run at a new specialization adds a compiled
variant, the same call again adds none (so a rise inside a timed window means compiles were timed)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_compile_counter_rises_once_per_new_variant():
    from loraplex.bench.instrument import triton_compiled_kernels
    from loraplex.kernels import fused_ops

    x = torch.randn(3, 1000, device="cuda", dtype=torch.float16)  # a width no other test uses: a new variant
    w = torch.ones(1000, device="cuda", dtype=torch.float16)
    before = triton_compiled_kernels()
    assert before >= 0
    fused_ops.rms_norm(x, w, 1e-5)
    torch.cuda.synchronize()
    after = triton_compiled_kernels()
    assert after >= before + 1
    fused_ops.rms_norm(x, w, 1e-5)
    torch.cuda.synchronize()
    assert triton_compiled_kernels() == after
