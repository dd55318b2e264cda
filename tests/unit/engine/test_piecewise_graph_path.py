"""The piecewise CUDA-graph path's Python on the CPU (``make_piecewise_runner(capture=False)``): prefill and mixed
steps run as pieces around attention over static buffers padded to a token bucket (token 0, KV slot -1, LoRA slot
-1), and give the eager path's tokens and logprobs, prompt logprobs included, with adapters mixed in."""

from __future__ import annotations

import pytest

from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.engine.config import EngineConfig
from loraplex.engine.piecewise_graphs import token_buckets
from tests.conftest import adapter_dir


def test_token_buckets_cover_every_count_with_little_padding():
    for max_tokens in (1, 7, 16, 100, 256, 2048, 5000):
        buckets = token_buckets(max_tokens)
        assert buckets == sorted(set(buckets)) and buckets[-1] == max_tokens
        for t in range(1, max_tokens + 1):
            b = next(b for b in buckets if b >= t)
            assert b - t < max(16, t / 7), (max_tokens, t, b)
    assert len(token_buckets(2048)) == 35


def test_piecewise_graph_max_tokens_is_checked():
    with pytest.raises(ValueError, match="piecewise_graph_max_tokens must be >= 1"):
        EngineConfig(model="", piecewise_graph_max_tokens=0)


def _llm(tiny_model, piecewise: bool, max_tokens: int = 2048, max_num_batched_tokens: int = 40, **kw) -> LLM:
    llm = LLM(tiny_model["model_dir"], dtype="float32", enable_lora=True, max_loras=4, max_num_seqs=32,
              max_num_batched_tokens=max_num_batched_tokens, piecewise_graph_max_tokens=max_tokens, **kw)
    runner = llm.engine.runner
    assert runner.piecewise is None  # no CUDA graphs on the CPU
    if piecewise:
        runner.piecewise = runner.make_piecewise_runner(capture=False)
    return llm


def _workload(tiny_model):
    loras = [LoRARequest(f"a{i}", i + 1, adapter_dir(tiny_model, i)) for i in range(3)]
    mix = [loras[0], None, loras[1], loras[2], None, loras[0], None]
    # prompts longer than the 40-token budget are chunked, so later steps mix decodes with prompt chunks
    prompts = [{"prompt_token_ids": [1] + [7 + 13 * i + j for j in range(5 + 11 * i)]} for i in range(len(mix))]
    params = [SamplingParams(max_tokens=3 + 2 * i, temperature=0, ignore_eos=True, logprobs=0,
                             prompt_logprobs=0 if i % 3 == 0 else None) for i in range(len(mix))]
    return prompts, params, mix


def _same(want, got, tol=1e-4):
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for lw, lg in zip(w.outputs[0].logprobs, g.outputs[0].logprobs):
            (t, v), = lw.items()
            assert lg[t].logprob == pytest.approx(v.logprob, abs=tol)
        assert (w.prompt_logprobs is None) == (g.prompt_logprobs is None)
        for lw, lg in zip(w.prompt_logprobs or [], g.prompt_logprobs or []):
            if lw is None:
                assert lg is None
                continue
            (t, v), = lw.items()
            assert lg[t].logprob == pytest.approx(v.logprob, abs=tol)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8", "int8"])
def test_piecewise_path_matches_eager_with_adapters_and_mixed_steps(tiny_model, kv_cache_dtype):
    prompts, params, mix = _workload(tiny_model)
    eager = _llm(tiny_model, piecewise=False, kv_cache_dtype=kv_cache_dtype).generate(prompts, params, lora_request=mix)
    llm = _llm(tiny_model, piecewise=True, kv_cache_dtype=kv_cache_dtype)
    got = llm.generate(prompts, params, lora_request=mix)
    # a quantized cache: the two paths' K/V may differ in the last fp32 bit before rounding, and where that flips
    # one 8-bit step the logprobs move: ~1e-4 under pytest-xdist (its thread count differs), and once 4.1e-3 for
    # a prompt logprob with fp8 (e4m3 steps are 1/16-1/8 of the value) in a plain run; the tokens stay equal
    tol = 1e-4 if kv_cache_dtype == "auto" else 1e-2
    _same(eager, got, tol)
    pw = llm.engine.runner.piecewise
    assert pw.num_steps > 0 and pw.num_graphs == 0  # the static path ran, nothing captured
    assert llm.engine.counters["num_piecewise_graph_steps"] == pw.num_steps == llm.engine.get_stats().piecewise_graph_steps
    buckets = {b for b, _ in pw.used_keys}
    assert 48 in buckets or 40 in buckets  # full 40-token steps, padded to their bucket
    assert any(mode for _, mode in pw.used_keys) and any(not mode for _, mode in pw.used_keys)
    # the same keys again with other contents (another order, other steps' shapes)
    again = llm.generate(prompts[::-1], params[::-1], lora_request=mix[::-1])
    _same(eager, again[::-1], tol)


def test_steps_beyond_the_largest_bucket_run_eagerly(tiny_model):
    prompts, params, mix = _workload(tiny_model)
    eager = _llm(tiny_model, piecewise=False).generate(prompts, params, lora_request=mix)
    llm = _llm(tiny_model, piecewise=True, max_tokens=20)
    assert llm.engine.runner.piecewise.buckets[-1] == 20
    got = llm.generate(prompts, params, lora_request=mix)
    _same(eager, got)
    pw = llm.engine.runner.piecewise
    assert pw.num_steps > 0 and all(b <= 20 for b, _ in pw.used_keys)


def _long_workload(tiny_model):
    loras = [LoRARequest(f"a{i}", i + 1, adapter_dir(tiny_model, i)) for i in range(3)]
    mix = [loras[0], loras[1], None, loras[2], loras[0], None, loras[1]]
    lengths = [70, 5, 90, 8, 100, 60, 6]  # requests of more than 32 tokens hold most of the prompt steps' tokens
    prompts = [{"prompt_token_ids": [1] + [(7 + 13 * i + j) % 90 + 3 for j in range(n)]} for i, n in enumerate(lengths)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0)
    return prompts, params, mix


def test_piecewise_graphs_keep_the_decode_tiles_with_segment_tiles_on(tiny_model, lora_steps):
    """Engine option lora_segment_tiles reaches eager steps only: the graphs' buckets (2,048 tokens at most) sit below
    lora_ops.PREFILL_TILES_MIN_TOKENS, where the decode tiles were measured faster for every mix (run 24), so their
    LoRA steps are never told the long-request count and no graph variant is added."""
    prompts, params, mix = _long_workload(tiny_model)
    kw = dict(max_num_batched_tokens=160)
    eager = _llm(tiny_model, piecewise=False, **kw).generate(prompts, params, lora_request=mix)
    llm = _llm(tiny_model, piecewise=True, lora_segment_tiles=True, **kw)
    lora_steps.clear()
    got = llm.generate(prompts, params, lora_request=mix)
    _same(eager, got)
    pw = llm.engine.runner.piecewise
    assert pw.num_steps > 0 and {mode for _, mode in pw.used_keys} <= {False, True}
    assert lora_steps and all(s.long_tokens is None for s in lora_steps)
