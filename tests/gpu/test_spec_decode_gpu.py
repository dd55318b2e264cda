"""Speculative decoding (prompt-lookup drafts) on CUDA: the verify step runs k + 1 query tokens per sequence through
the Triton attention and LoRA kernels, and drafts change which steps can replay a decode CUDA graph. float32 greedy
tokens equal the same engine without drafts, with adapters in the batch; bfloat16 random sampling with drafts
runs to its lengths."""

from __future__ import annotations

from loraplex import LLM, LoRARequest, SamplingParams
from tests.conftest import adapter_dir
from tests.unit.engine.test_spec_decode import _prompts, _run


def test_cuda_greedy_with_drafts_equals_without(tiny_model):
    kw = dict(device="cuda", dtype="float32", enable_lora=True, max_loras=3, max_num_batched_tokens=64, seed=2)
    plain = LLM(tiny_model["model_dir"], **kw)
    spec = LLM(tiny_model["model_dir"], num_speculative_tokens=4, **kw)
    prompts = _prompts(4)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (40, 33, 17, 40, 9)]
    loras = [None, LoRARequest("a0", 1, adapter_dir(tiny_model, 0)), LoRARequest("a3", 4, adapter_dir(tiny_model, 3)),
             LoRARequest("a0", 1, adapter_dir(tiny_model, 0)), None]
    want = _run(plain, prompts, params, loras)
    got = _run(spec, prompts, params, loras)
    assert got == want
    sched = spec.engine.scheduler
    assert sched.num_draft_tokens > 0 and 0 < sched.num_accepted_tokens < sched.num_draft_tokens


def test_cuda_bfloat16_random_sampling_with_drafts(tiny_model):
    # one-token lookups and a top-k: a random tiny model's samples rarely repeat a 2-gram of their context
    spec = LLM(tiny_model["model_dir"], device="cuda", dtype="bfloat16", num_speculative_tokens=3, seed=7,
               prompt_lookup_min=1)
    params = SamplingParams(max_tokens=30, temperature=0.7, top_k=20, ignore_eos=True)  # (seeds, logprobs: no drafts)
    outs = spec.generate([{"prompt_token_ids": p} for p in _prompts(5)], params)
    for out in outs:
        assert len(out.outputs[0].token_ids) == 30
        assert all(0 <= t < spec.engine.runner.model_config.vocab_size for t in out.outputs[0].token_ids)
    assert spec.engine.scheduler.num_draft_tokens > 0
