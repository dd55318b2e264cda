"""``fuse_lora_silu_mul`` on CUDA (Triton kernels, CUDA graphs): fp32 the unfused path's tokens and logprobs; bf16
the same up to near ties (the fused kernel rounds gate and up as the unfused expand's store does)."""

from __future__ import annotations

import pytest
import torch

from loraplex import LLM
from tests.gpu.test_cuda_graphs import _compare, mixed_requests

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_silu_mul_matches_the_unfused_path(tiny_model, dtype):
    prompts, mix, params = mixed_requests(tiny_model, seed=5)

    def run(fuse: bool):
        llm = LLM(tiny_model["model_dir"], device="cuda", dtype=dtype, enable_lora=True, max_loras=4,
                  max_lora_rank=64, max_num_seqs=64, fuse_lora_silu_mul=fuse)
        return llm.generate(prompts, params, lora_request=mix)

    compared = _compare(run(False), run(True), dtype)
    assert compared >= (1.0 if dtype == "float32" else 0.8) * 40 * 12
