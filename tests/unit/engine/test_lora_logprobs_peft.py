"""Float32 on the CPU: with adapters, the engine's logprobs and prompt logprobs are PEFT's, per request, for
Llama (GQA, llama3 rope scaling) and Qwen2 (q|k|v bias, MQA), adapters of different ranks and base requests in
the same batch. (Token-level equality with PEFT is covered elsewhere; this checks the distributions.)"""

from __future__ import annotations

import pytest
import torch

from loraplex import LLM, LoRARequest, SamplingParams
from tests.conftest import adapter_dir
from tests.unit.engine.conftest import hf_logprobs

MAX_NEW = 6
TOP = 4


def _peft(model_dir: str, path: str | None):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return base if path is None else PeftModel.from_pretrained(base, path).eval()


@pytest.mark.parametrize("fixture, indices", [("tiny_model", (None, 0, 3, 5)), ("tiny_qwen2", (None, 0, 1))])
def test_logprobs_and_prompt_logprobs_with_mixed_adapters_match_peft(fixture, indices, request):
    manifest = request.getfixturevalue(fixture)
    model_dir = manifest["model_dir"]
    llm = LLM(model_dir, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=64,
              max_num_batched_tokens=24)  # prompts run in several chunks
    loras = [None if i is None else LoRARequest(f"a{i}", i + 1, adapter_dir(manifest, i)) for i in indices]
    prompts = [[1] + [(37 * k + 11 * n) % 500 + 8 for k in range(9 + 7 * n)] for n in range(len(indices))]
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True, logprobs=TOP, prompt_logprobs=TOP)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=loras)
    for out, prompt, lora in zip(outs, prompts, loras):
        comp = out.outputs[0]
        assert comp.finish_reason == "length" and len(comp.token_ids) == MAX_NEW
        want = hf_logprobs(_peft(model_dir, lora and lora.lora_path), prompt + comp.token_ids)
        # a generated token's entry: its own logprob, rank 1 (greedy) and PEFT's top-N
        for step, (entry, token) in enumerate(zip(comp.logprobs, comp.token_ids)):
            row = want[len(prompt) - 1 + step]
            assert int(row.argmax()) == token, (lora, step)
            top = torch.topk(row, TOP)
            assert set(entry) == set(top.indices.tolist()), (lora, step)
            for t, lp in entry.items():
                assert lp.logprob == pytest.approx(float(row[t]), abs=1e-4), (lora, step, t)
        # prompt logprobs: None for the first token, then each prompt token's logprob under PEFT
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for pos in range(1, len(prompt)):
            entry, row = out.prompt_logprobs[pos], want[pos - 1]
            assert entry[prompt[pos]].logprob == pytest.approx(float(row[prompt[pos]]), abs=1e-4), (lora, pos)
            assert entry[prompt[pos]].rank == int((row > row[prompt[pos]]).sum()) + 1, (lora, pos)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
