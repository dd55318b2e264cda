"""Engine option ``lora_overlap_shrink`` off the GPU: it reaches the LoRA manager, and a step only overlaps on CUDA
with the Triton kernels (here the twins run, in order, with the same tokens). The overlap itself is checked
bit for bit on CUDA (tests/gpu/test_lora_overlap_gpu.py)."""

from __future__ import annotations

from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.engine.config import EngineConfig
from tests.conftest import adapter_dir


def test_overlap_option_reaches_the_manager_and_stays_off_on_the_cpu(tiny_model, lora_steps):
    assert EngineConfig(model="m").lora_overlap_shrink is False
    loras = [LoRARequest(f"a{i}", i + 1, adapter_dir(tiny_model, i)) for i in range(2)]
    mix = [loras[0], None, loras[1], loras[0]]
    prompts = [{"prompt_token_ids": [1] + [7 + 13 * i + j for j in range(5 + 6 * i)]} for i in range(len(mix))]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    steps = lora_steps
    want = LLM(tiny_model["model_dir"], dtype="float32", enable_lora=True, max_loras=4,
               max_num_seqs=8).generate(prompts, params, lora_request=mix)
    llm = LLM(tiny_model["model_dir"], dtype="float32", enable_lora=True, max_loras=4, max_num_seqs=8,
              lora_overlap_shrink=True)
    assert llm.engine.runner.lora_manager.overlap_shrink is True
    steps.clear()
    got = llm.generate(prompts, params, lora_request=mix)
    assert any(s.num_active for s in steps) and not any(s.overlap_shrink for s in steps)
    assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]
