"""``fuse_lora_silu_mul`` on CUDA (Triton kernels, CUDA graphs): fp32 the unfused path's tokens and logprobs; bf16
the same up to near ties (the fused kernel rounds gate and up as the unfused expand's store does)."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.test_cuda_graphs import _compare, generate_with, mixed_requests

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_silu_mul_matches_the_unfused_path(tiny_model, dtype):
    requests = mixed_requests(tiny_model, seed=5)
    # both in the usual order (GEMM, then the expand adding into its output): the fused kernel rounds as that
    # expand does, not as the write-first order of large steps (which would then differ in gate|up alone)
    order = {"lora_expand_first_min_tokens": 0}
    _, plain = generate_with(tiny_model, dtype, requests, fuse_lora_silu_mul=False, **order)
    _, fused = generate_with(tiny_model, dtype, requests, fuse_lora_silu_mul=True, **order)
    compared = _compare(plain, fused, dtype)
    assert compared >= (1.0 if dtype == "float32" else 0.8) * 40 * 12
