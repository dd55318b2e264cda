"""Engine option ``lora_segment_tiles`` off the GPU: it reaches the LoRA manager, and each eager step that is not pure
decode tells its LoRA step how many of its tokens sit in requests of more than 32 (what picks the kernel tiles on
CUDA, ``lora_ops.choose_config``); off, the steps are told nothing. Tokens are the same either way (here the twins
run; the tiles themselves are compared with the twins in tests/unit/kernels/test_lora_step_interp.py)."""

from __future__ import annotations

from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.engine.config import EngineConfig
from tests.conftest import adapter_dir


def _run(tiny_model, steps, **kw):
    loras = [LoRARequest(f"a{i}", i + 1, adapter_dir(tiny_model, i)) for i in range(2)]
    mix = [loras[0], loras[1], None, loras[0]]
    # two short prompts and two of 40+ tokens: the long ones' steps hold most tokens in requests of more than 32
    lengths = [5, 40, 8, 45]
    prompts = [{"prompt_token_ids": [1] + [(7 + 13 * i + j) % 90 + 3 for j in range(n)]}
               for i, n in enumerate(lengths)]
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    llm = LLM(tiny_model["model_dir"], dtype="float32", enable_lora=True, max_loras=4, max_num_seqs=8, **kw)
    steps.clear()
    got = llm.generate(prompts, params, lora_request=mix)
    return llm, [g.outputs[0].token_ids for g in got], [s for s in steps if s.num_active]


def test_segment_tiles_option_tells_each_eager_step_its_long_tokens(tiny_model, lora_steps):
    assert EngineConfig(model="m").lora_segment_tiles is False
    _, want, off_steps = _run(tiny_model, lora_steps)
    assert off_steps and all(s.long_tokens is None for s in off_steps)
    llm, got, on_steps = _run(tiny_model, lora_steps, lora_segment_tiles=True)
    assert llm.engine.runner.lora_manager.segment_tiles is True
    assert got == want
    prompt_steps = [s for s in on_steps if s.token_slots.shape[0] > 4]
    assert prompt_steps and all(s.long_tokens is not None for s in prompt_steps)
    # the prompts of 41 and 46 tokens, in one step or in two (adapters load in the background: a request waits for
    # its own, so either long prompt may start a step after the other)
    assert all(s.long_tokens <= s.token_slots.shape[0] for s in prompt_steps)
    assert sorted(s.long_tokens for s in prompt_steps if s.long_tokens) in ([41 + 46], [41, 46])
    decode_steps = [s for s in on_steps if s.token_slots.shape[0] <= 4]
    assert decode_steps and all(s.long_tokens is None for s in decode_steps)  # pure decode: nothing to tell
