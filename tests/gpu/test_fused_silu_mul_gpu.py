"""``fuse_lora_silu_mul`` on CUDA (Triton kernels, CUDA graphs): fp32 the unfused path's tokens and logprobs; bf16
the same up to near ties (the fused kernel rounds gate and up as the unfused expand's store does)."""

from __future__ import annotations

import pytest
import torch

from loraplex import LLM, LoRARequest, SamplingParams
from tests.conftest import adapter_dir
from tests.gpu.test_cuda_graphs import _compare

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_silu_mul_matches_the_unfused_path(tiny_model, dtype):
    loras = [LoRARequest(f"a{i}", i + 1, adapter_dir(tiny_model, i)) for i in range(3)]
    gen = torch.Generator().manual_seed(5)
    prompts, mix = [], []
    for i in range(40):
        length = int(torch.randint(1, 120, (1,), generator=gen))
        prompts.append({"prompt_token_ids": [1] + torch.randint(8, 500, (length,), generator=gen).tolist()})
        mix.append(None if i % 4 == 3 else loras[i % 3])
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)

    def run(fuse: bool):
        llm = LLM(tiny_model["model_dir"], device="cuda", dtype=dtype, enable_lora=True, max_loras=4,
                  max_lora_rank=64, max_num_seqs=64, fuse_lora_silu_mul=fuse)
        return llm.generate(prompts, params, lora_request=mix)

    compared = _compare(run(False), run(True), dtype)
    assert compared >= (1.0 if dtype == "float32" else 0.8) * 40 * 12
