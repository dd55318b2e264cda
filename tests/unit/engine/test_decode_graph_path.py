"""The CUDA-graph decode path's Python on the CPU: static buffers, bucket padding (slot -1, sequence length
0, LoRA slot -1) and graph keys, run without capture (``make_graph_runner(capture=False)``), give the same
tokens and logprobs as the eager path, with adapters mixed in and batches between buckets."""

from __future__ import annotations

import pytest

from loraplex import LLM, LoRARequest, SamplingParams
from tests.conftest import adapter_dir


def _llm(tiny_model, padded: bool, kv_cache_dtype: str = "auto") -> LLM:
    llm = LLM(tiny_model["model_dir"], dtype="float32", enable_lora=True, max_loras=4, max_num_seqs=32,
              kv_cache_dtype=kv_cache_dtype)
    runner = llm.engine.runner
    assert runner.graphs is None  # no CUDA graphs on the CPU
    if padded:
        runner.graphs = runner.make_graph_runner(capture=False)
    return llm


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8", "int8"])
def test_padded_decode_path_matches_eager_with_adapters(tiny_model, kv_cache_dtype):
    loras = [LoRARequest(f"a{i}", i + 1, adapter_dir(tiny_model, i)) for i in range(3)]
    # 7 sequences (between the buckets 4 and 8); adapters finish first, so the last steps have none
    mix = [loras[0], loras[1], None, loras[2], loras[0], None, None]
    prompts = [{"prompt_token_ids": [1] + [7 + 13 * i + j for j in range(5 + 9 * i)]} for i in range(len(mix))]
    params = [SamplingParams(max_tokens=4 + 3 * i, temperature=0, ignore_eos=True, logprobs=0)
              for i in range(len(mix))]
    eager = _llm(tiny_model, False, kv_cache_dtype).generate(prompts, params, lora_request=mix)
    padded_llm = _llm(tiny_model, True, kv_cache_dtype)
    padded = padded_llm.generate(prompts, params, lora_request=mix)
    for e, p in zip(eager, padded):
        assert p.outputs[0].token_ids == e.outputs[0].token_ids
        for le, lp in zip(e.outputs[0].logprobs, p.outputs[0].logprobs):
            (te, ve), = le.items()
            assert lp[te].logprob == pytest.approx(ve.logprob, abs=1e-4)
    graphs = padded_llm.engine.runner.graphs
    keys = graphs.used_keys
    assert graphs.num_replays > 0 and graphs.num_graphs == 0  # replays ran the static path, nothing captured
    assert {b for b, _ in keys} >= {8, 4, 1}  # 7, then 5..6, 3..4 and 1 sequences: padded to their buckets
    assert any(n for _, n in keys) and any(not n for _, n in keys)  # with and without adapters

    # a second run on the same runner reuses the keys with different contents (other batch than at "capture")
    again = padded_llm.generate(prompts[::-1], params[::-1], lora_request=mix[::-1])
    assert [o.outputs[0].token_ids for o in again[::-1]] == [o.outputs[0].token_ids for o in eager]



def test_padded_decode_path_on_merged_weights(tiny_model):
    """Decode steps whose sequences all use one adapter run the base graph on merged weights (merge_single_lora)
    and give the eager kernel path's tokens; a step with base sequences beside the adapter's restores the
    weights and takes the adapters' graph."""
    lora = LoRARequest("a0", 1, adapter_dir(tiny_model, 0))
    prompts = [{"prompt_token_ids": [1] + [9 + 11 * i + j for j in range(4 + 5 * i)]} for i in range(5)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0)
    mixes = [[lora] * 5, [lora, None, lora, lora, None]]
    eager = _llm(tiny_model, padded=False)
    want = [eager.generate(prompts, params, lora_request=m) for m in mixes]
    llm = LLM(tiny_model["model_dir"], dtype="float32", enable_lora=True, max_loras=4, max_num_seqs=32,
              merge_single_lora=True)
    runner = llm.engine.runner
    runner.graphs = runner.make_graph_runner(capture=False)
    merged = runner.get_lora_manager().merged
    merged.min_steps = merged.threshold = 1
    got = []
    for m in mixes:
        runner.graphs.used_keys.clear()
        got.append(llm.generate(prompts, params, lora_request=m))
        got_keys = {mode for _, mode in runner.graphs.used_keys}
        # all on the adapter: the base graph only (merged); mixed: the adapters' graph (kernels)
        assert got_keys == ({False} if m == mixes[0] else {True}), got_keys
    for w_run, g_run in zip(want, got):
        for w, g in zip(w_run, g_run):
            assert g.outputs[0].token_ids == w.outputs[0].token_ids
            for lw, lg in zip(w.outputs[0].logprobs, g.outputs[0].logprobs):
                (t, v), = lw.items()
                assert lg[t].logprob == pytest.approx(v.logprob, abs=1e-4)
    assert merged.num_merged_steps >= 6 and merged.merged is None
