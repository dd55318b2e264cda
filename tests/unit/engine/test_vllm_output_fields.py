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


def test_truncate_prompt_tokens_runs_the_prompts_last_tokens(llm):
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    text = "The river runs past the old mill and on to the sea"
    full_ids = llm.get_tokenizer().encode(text)
    assert len(full_ids) > 6
    cut = llm.generate(text, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True,
                                            truncate_prompt_tokens=6))[0]
    want = llm.generate({"prompt_token_ids": full_ids[-6:]}, params)[0]
    assert cut.prompt_token_ids == full_ids[-6:] and cut.prompt == text  # the prompt as given, as in vLLM
    assert cut.outputs[0].token_ids == want.outputs[0].token_ids
    ids = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=2, truncate_prompt_tokens=4))[0]
    assert ids.prompt_token_ids == PROMPT[-4:]
    short = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=2, truncate_prompt_tokens=-1))[0]
    assert short.prompt_token_ids == PROMPT  # -1: max_model_len (64) tokens, more than the prompt has


def test_truncate_prompt_tokens_over_max_model_len_is_refused_naming_it(llm):
    from loraplex.engine.sampling_params import SamplingParamsError

    with pytest.raises(SamplingParamsError, match="^truncate_prompt_tokens: .*64"):
        llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(truncate_prompt_tokens=65))
    assert llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=1))[0].finished  # still usable


@pytest.mark.parametrize("value", [0, -2, 2.5, "4", True])
def test_truncate_prompt_tokens_must_be_at_least_one_or_minus_one(value):
    from loraplex.engine.sampling_params import SamplingParamsError

    with pytest.raises(SamplingParamsError, match="^truncate_prompt_tokens: "):
        SamplingParams(truncate_prompt_tokens=value)


def test_detokenize_false_returns_the_same_token_ids_without_text(llm):
    kw = dict(max_tokens=8, temperature=0.7, seed=5, ignore_eos=True, logprobs=2, n=2)
    shown, bare = llm.generate([{"prompt_token_ids": PROMPT}] * 2,
                               [SamplingParams(**kw), SamplingParams(**kw, detokenize=False)])
    for a, b in zip(shown.outputs, bare.outputs):
        assert a.text and b.text == ""
        assert b.token_ids == a.token_ids and b.finish_reason == "length"
        assert b.cumulative_logprob == pytest.approx(a.cumulative_logprob)
        assert all(lp.decoded_token is None for entry in b.logprobs for lp in entry.values())
        assert all(lp.decoded_token is not None for entry in a.logprobs for lp in entry.values())


def test_detokenize_false_with_stop_strings_is_refused_as_in_vllm():
    from loraplex.engine.sampling_params import SamplingParamsError

    with pytest.raises(SamplingParamsError, match="^stop: .*detokenize=True"):
        SamplingParams(stop=["\n"], detokenize=False)
    with pytest.raises(SamplingParamsError, match="^detokenize: "):
        SamplingParams(detokenize="no")
    SamplingParams(stop_token_ids=[2], detokenize=False)  # token ids need no text
