"""Offline-API fields a vLLM user reads: ``cumulative_logprob``, ``truncate_prompt_tokens``, ``detokenize``."""

from __future__ import annotations

import pytest

from loraplex import LLM, SamplingParams

PROMPT = [1] + list(range(30, 50))


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(tiny_model["model_dir"], dtype="float32", max_model_len=64)


def test_cumulative_logprob_is_none_unless_logprobs_were_asked(llm):
    base = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    plain, with_logprobs = llm.generate([{"prompt_token_ids": PROMPT}] * 2,
                                        [base, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                                              logprobs=0)])
    assert plain.outputs[0].cumulative_logprob is None and plain.outputs[0].logprobs is None
    comp = with_logprobs.outputs[0]
    assert comp.token_ids == plain.outputs[0].token_ids
    assert comp.cumulative_logprob == pytest.approx(sum(e[t].logprob for e, t in zip(comp.logprobs, comp.token_ids)))
    assert comp.cumulative_logprob < 0
