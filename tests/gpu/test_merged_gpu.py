"""Merged single-adapter steps on CUDA (bf16, CUDA graphs): the kernel path's tokens (up to bf16 near ties),
decode steps replayed from the base graphs on merged weights, and the pristine weights back bit for bit after a
step with base sequences."""

from __future__ import annotations

import pytest
import torch

from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.adapters.merged import WEIGHT_OF
from tests.conftest import adapter_dir
from tests.gpu.test_cuda_graphs import _compare

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_merged_single_adapter_steps_match_the_kernel_path(tiny_model):
    loras = [LoRARequest(f"a{i}", i + 1, adapter_dir(tiny_model, i)) for i in range(2)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=2)
    prompts = [{"prompt_token_ids": [1] + list(range(20 + i, 40 + 3 * i))} for i in range(12)]
    mixes = [[loras[1]] * 12, [loras[0] if i % 4 else None for i in range(12)], [loras[0]] * 12]

    def run(merge: bool):
        llm = LLM(tiny_model["model_dir"], device="cuda", dtype="bfloat16", enable_lora=True, max_loras=4,
                  max_lora_rank=64, max_num_seqs=16, merge_single_lora=merge)
        if merge:
            merged = llm.engine.runner.get_lora_manager().merged
            merged.min_steps = merged.threshold = 2
        outs = []
        for mix in mixes:
            if merge:
                llm.engine.runner.graphs.used_keys.clear()
            outs.append(llm.generate(prompts, params, lora_request=mix))
            if merge:
                keys = {mode for _, mode in llm.engine.runner.graphs.used_keys}
                if mix is mixes[1]:
                    # base sequences beside the adapter's: the adapters' graphs. The adapter's first use is read
                    # in the background, so its sequences may start (and end) a few steps after the base ones:
                    # those last steps have the adapter alone and may run merged
                    assert True in keys, keys
                else:
                    assert keys == {False}, keys  # merged: the base graphs only
        return llm, outs

    _, want = run(False)
    llm, got = run(True)
    compared = sum(_compare(w, g, "bfloat16") for w, g in zip(want, got))
    assert compared >= 0.8 * 3 * 12 * 16  # bf16: a sequence is compared up to its first near tie
    merged = llm.engine.runner.lora_manager.merged
    assert merged.num_merges >= 2 and merged.num_merged_steps >= 2 * 14
    llm.generate(prompts[:2], params)  # base sequences: the pristine weights back
    assert merged.merged is None
    model = llm.engine.runner.model
    assert all(torch.equal(merged.pristine[p][i], getattr(layer, WEIGHT_OF[p]))
               for i, layer in enumerate(model.layers) for p in WEIGHT_OF)
