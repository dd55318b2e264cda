"""Float32 on the CPU: the engine gives exactly Hugging Face's greedy tokens and logprobs, with chunked
prefill, requests joining mid-generation, prefix caching and preemption."""

from __future__ import annotations

import random

import pytest
import torch

from loraplex import LLM, SamplingParams
from loraplex.engine.config import EngineConfig
from loraplex.engine.engine_core import LLMEngine
from tests.unit.engine.conftest import hf_greedy, hf_logprobs

MAX_NEW = 12


def _prompts(vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 3, 7, 16, 17, 33, 50, 90]
    return [[1] + [rng.randrange(8, vocab) for _ in range(n)] for n in lengths]


def _run_with_late_arrivals(engine: LLMEngine, prompts, params) -> dict[str, list[int]]:
    """Half the prompts start together; the rest join one at a time while the others are generating."""
    got = {str(i): [] for i in range(len(prompts))}
    for i in range(4):
        engine.add_request(str(i), prompts[i], params)
    nxt, step = 4, 0
    while engine.has_unfinished_requests() or nxt < len(prompts):
        step += 1
        if nxt < len(prompts) and step % 3 == 0:
            engine.add_request(str(nxt), prompts[nxt], params)
            nxt += 1
        for d in engine.step():
            got[d.request_id].extend(d.token_ids)
    return got


@pytest.mark.parametrize("fixture", ["tiny_model", "tiny_qwen2", "tiny_mistral_tied"])
def test_greedy_tokens_match_hf_with_requests_joining_mid_generation(fixture, request):
    from transformers import AutoModelForCausalLM

    model_dir = request.getfixturevalue(fixture)["model_dir"]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = _prompts(hf.config.vocab_size, seed=len(fixture))
    engine = LLMEngine(EngineConfig(model=model_dir, dtype="float32", max_num_batched_tokens=40))
    got = _run_with_late_arrivals(engine, prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True))
    for i, p in enumerate(prompts):
        assert got[str(i)] == hf_greedy(hf, p, MAX_NEW), f"prompt {i} ({len(p)} tokens)"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_logprobs_and_prompt_logprobs_match_hf(tiny_model, hf_llama):
    llm = LLM(tiny_model["model_dir"], dtype="float32", max_num_batched_tokens=16)
    prompt = _prompts(512, seed=3)[5]  # 34 tokens: prompt logprobs over three chunks
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=5, prompt_logprobs=3)
    out = llm.generate({"prompt_token_ids": prompt}, params)[0]
    comp = out.outputs[0]
    ref = hf_logprobs(hf_llama, prompt + comp.token_ids)
    for k, (tok, entry) in enumerate(zip(comp.token_ids, comp.logprobs)):
        row = ref[len(prompt) - 1 + k]
        top_vals, top_ids = row.topk(5)
        assert set(entry) == set(top_ids.tolist()) | {tok}
        assert entry[tok].rank == 1  # greedy picks the top token
        for tid, lp in entry.items():
            assert abs(lp.logprob - row[tid].item()) < 1e-4
    assert comp.cumulative_logprob == pytest.approx(
        sum(ref[len(prompt) - 1 + k, t].item() for k, t in enumerate(comp.token_ids)), abs=1e-3)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for j in range(1, len(prompt)):
        entry, row = out.prompt_logprobs[j], ref[j - 1]
        assert prompt[j] in entry and abs(entry[prompt[j]].logprob - row[prompt[j]].item()) < 1e-4
        assert entry[prompt[j]].rank == int((row > row[prompt[j]]).sum()) + 1
        for tid in row.topk(3).indices.tolist():
            assert abs(entry[tid].logprob - row[tid].item()) < 1e-4


def test_shared_prefix_computes_only_the_suffix(tiny_model):
    engine = LLMEngine(EngineConfig(model=tiny_model["model_dir"], dtype="float32"))
    rng = random.Random(5)
    prefix = [1] + [rng.randrange(8, 512) for _ in range(63)]  # 64 tokens = 4 full blocks
    suffix = [rng.randrange(8, 512) for _ in range(9)]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)

    def serve(rid, tokens, **kw):
        before = engine.scheduler.num_computed_prompt_tokens
        engine.add_request(rid, tokens, params, **kw)
        toks, cached = [], None
        while engine.has_unfinished_requests():
            for d in engine.step():
                toks.extend(d.token_ids)
                cached = d.num_cached_tokens
        return toks, engine.scheduler.num_computed_prompt_tokens - before, cached

    cold_toks, _, _ = serve("cold", prefix + suffix)
    engine.block_manager.reset_prefix_cache()
    engine.add_request("first", prefix + [7, 7, 7], params)
    while engine.has_unfinished_requests():
        engine.step()
    toks, computed, cached = serve("second", prefix + suffix)
    assert (computed, cached) == (len(suffix), 64)
    assert toks == cold_toks
    toks, computed, cached = serve("salted", prefix + suffix, cache_salt="other-tenant")
    assert (computed, cached) == (len(prefix + suffix), 0) and toks == cold_toks
    assert engine.counters["prefix_cache_hit_tokens"] == 64


def test_preemption_under_small_kv_budget_gives_unconstrained_outputs(tiny_model):
    prompts = _prompts(512, seed=9)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    ample = LLM(tiny_model["model_dir"], dtype="float32")
    tight = LLM(tiny_model["model_dir"], dtype="float32", num_kv_blocks=12, max_num_batched_tokens=64)
    want = [o.outputs[0].token_ids for o in ample.generate([{"prompt_token_ids": p} for p in prompts], params)]
    got = [o.outputs[0].token_ids for o in tight.generate([{"prompt_token_ids": p} for p in prompts], params)]
    assert got == want
    assert tight.engine.counters["num_preemptions"] > 0 and ample.engine.counters["num_preemptions"] == 0
    assert tight.engine.block_manager.num_free_blocks == 12


def test_forked_greedy_samples_survive_copy_on_write_and_preemption(tiny_model, hf_llama):
    prompts = _prompts(512, seed=11)[3:7]  # 17..51 tokens: partly filled last blocks get shared by forks
    params = SamplingParams(n=3, max_tokens=20, temperature=0, ignore_eos=True)
    llm = LLM(tiny_model["model_dir"], dtype="float32", num_kv_blocks=14, max_num_batched_tokens=48)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    counters = llm.engine.counters
    assert counters["cow_block_copies"] > 0 and counters["num_preemptions"] > 0
    for p, out in zip(prompts, outs):
        want = hf_greedy(hf_llama, p, 20)
        assert [c.token_ids for c in out.outputs] == [want] * 3
    assert llm.engine.block_manager.num_free_blocks == 14
