"""Merged single-adapter steps on CUDA (CUDA graphs): in fp32 the kernel path's tokens and logprobs; in bf16 no
less accurate than the kernel path, both measured against the fp32 kernel path (merged weights round
differently: ``round(W0 + s B A) x`` against ``round(x W0) + x A^T s B``, so the two bf16 runs are not compared
with each other at graph-vs-eager tolerance); decode steps replayed from the base graphs on merged weights; the
pristine weights back bit for bit after a step with base sequences."""

from __future__ import annotations

import pytest
import torch

from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.adapters.merged import WEIGHT_OF
from tests.conftest import adapter_dir
from tests.gpu.test_cuda_graphs import _compare

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _run(tiny_model, dtype: str, merge: bool, device: str = "cuda"):
    loras = [LoRARequest(f"a{i}", i + 1, adapter_dir(tiny_model, i)) for i in range(2)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=2)
    prompts = [{"prompt_token_ids": [1] + list(range(20 + i, 40 + 3 * i))} for i in range(12)]
    mixes = [[loras[1]] * 12, [loras[0] if i % 4 else None for i in range(12)], [loras[0]] * 12]
    llm = LLM(tiny_model["model_dir"], device=device, dtype=dtype, enable_lora=True, max_loras=4,
              max_lora_rank=64, max_num_seqs=16, merge_single_lora=merge)
    if merge:
        merged = llm.engine.runner.get_lora_manager().merged
        merged.min_steps = merged.threshold = 2
    outs = []
    for mix in mixes:
        graphs = llm.engine.runner.graphs
        if graphs is not None:
            graphs.used_keys.clear()
        outs.append(llm.generate(prompts, params, lora_request=mix))
        if merge and graphs is not None:
            keys = {mode for _, mode in graphs.used_keys}
            if mix is mixes[1]:
                # base sequences beside the adapter's: the adapters' graphs. The adapter's first use is read in
                # the background, so its sequences may start (and end) a few steps after the base ones: those
                # last steps have the adapter alone and may run merged
                assert True in keys, keys
            else:
                assert keys == {False}, keys  # merged: the base graphs only
    return llm, outs


def _errors(ref_outs, outs) -> list[float]:
    """|logprob - fp32 logprob| of the reference's token, every position up to the first token that differs."""
    errs = []
    for r, o in zip(ref_outs, outs):
        for k, (tr, to) in enumerate(zip(r.outputs[0].token_ids, o.outputs[0].token_ids)):
            if tr != to:
                break
            errs.append(abs(o.outputs[0].logprobs[k][tr].logprob - r.outputs[0].logprobs[k][tr].logprob))
    return errs


def test_merged_steps_fp32_equal_the_kernel_path_and_restore_the_weights(tiny_model):
    _, want = _run(tiny_model, "float32", merge=False)
    llm, got = _run(tiny_model, "float32", merge=True)
    assert sum(_compare(w, g, "float32") for w, g in zip(want, got)) == 3 * 12 * 16
    merged = llm.engine.runner.lora_manager.merged
    assert merged.num_merges >= 2 and merged.num_merged_steps >= 2 * 14
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2))  # a base step: restored
    assert merged.merged is None
    assert all(torch.equal(merged.pristine[p][i], getattr(layer, WEIGHT_OF[p]))
               for i, layer in enumerate(llm.engine.runner.model.layers) for p in WEIGHT_OF)


def test_merged_steps_bf16_are_as_accurate_as_the_kernel_path(tiny_model):
    _, ref = _run(tiny_model, "float32", merge=False)
    _, kernel = _run(tiny_model, "bfloat16", merge=False)
    llm, merged_outs = _run(tiny_model, "bfloat16", merge=True)
    assert llm.engine.runner.lora_manager.merged.num_merged_steps >= 2 * 14
    err_kernel = [e for r, o in zip(ref, kernel) for e in _errors(r, o)]
    err_merged = [e for r, o in zip(ref, merged_outs) for e in _errors(r, o)]
    assert len(err_merged) >= 0.5 * 3 * 12 * 16 and len(err_kernel) >= 0.5 * 3 * 12 * 16
    mean_k, mean_m = sum(err_kernel) / len(err_kernel), sum(err_merged) / len(err_merged)
    assert mean_m <= 2 * mean_k + 0.01, (mean_m, mean_k)
    assert max(err_merged) <= 2 * max(err_kernel) + 0.05, (max(err_merged), max(err_kernel))
