"""The dense single-adapter path on CUDA (bf16, CUDA graphs): the kernel path's tokens (up to bf16 near ties),
decode steps replayed from the dense graphs, and an adapter switch laid out between steps."""

from __future__ import annotations

import pytest
import torch

from loraplex import LLM, LoRARequest, SamplingParams
from tests.conftest import adapter_dir
from tests.gpu.test_cuda_graphs import _compare

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_dense_single_adapter_steps_match_the_kernel_path(tiny_model):
    loras = [LoRARequest(f"a{i}", i + 1, adapter_dir(tiny_model, i)) for i in range(2)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=2)
    prompts = [{"prompt_token_ids": [1] + list(range(20 + i, 40 + 3 * i))} for i in range(12)]
    mixes = [[loras[0] if i % 4 else None for i in range(12)], [loras[1]] * 12]

    def run(dense: bool):
        llm = LLM(tiny_model["model_dir"], device="cuda", dtype="bfloat16", enable_lora=True, max_loras=4,
                  max_lora_rank=64, max_num_seqs=16, dense_single_lora=dense)
        if dense:
            llm.engine.runner.get_lora_manager().dense.min_steps_between = 0  # switch at once
        return llm, [llm.generate(prompts, params, lora_request=mix) for mix in mixes]

    _, want = run(False)
    llm, got = run(True)
    compared = sum(_compare(w, g, "bfloat16") for w, g in zip(want, got))
    assert compared >= 0.8 * 2 * 12 * 16  # bf16: a sequence is compared up to its first near tie
    dense = llm.engine.runner.lora_manager.dense
    # the first batch: its prefill (its decode steps have base sequences: kernel mode); the second: its prefill
    # and its 15 decode steps
    assert dense.num_layouts == 2 and dense.num_dense_steps >= 16
    assert any(mode == "dense" for _, mode in llm.engine.runner.graphs.used_keys), "no dense graph replayed"
