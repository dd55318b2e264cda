"""Text, stop strings, finish reasons and request validation through the offline API."""

from __future__ import annotations

import pytest

from loraplex import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(tiny_model["model_dir"], dtype="float32")


def test_incremental_text_equals_full_decode(llm):
    tok = llm.get_tokenizer()
    outs = llm.generate(["The river runs", "Hello there", "A"], SamplingParams(max_tokens=40, temperature=0.8,
                                                                             seed=3, ignore_eos=True))
    for out in outs:
        comp = out.outputs[0]
        assert len(comp.token_ids) == 40 and comp.finish_reason == "length"
        full = tok.decode(comp.token_ids, skip_special_tokens=True)
        assert full.startswith(comp.text) and len(full) - len(comp.text) <= 1  # only an incomplete char held
        assert out.prompt_token_ids == tok.encode(out.prompt)


def test_stop_string_truncates_text_and_reports_it(llm):
    free = llm.generate("The river runs", SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0]
    text = free.outputs[0].text
    stop = text[10:13]
    assert stop.strip() and text.find(stop) == 10
    out = llm.generate("The river runs", SamplingParams(max_tokens=30, temperature=0, ignore_eos=True,
                                                        stop=[stop]))[0].outputs[0]
    assert out.text == text[:10] and out.finish_reason == "stop" and out.stop_reason == stop
    assert len(out.token_ids) < 30
    kept = llm.generate("The river runs", SamplingParams(max_tokens=30, temperature=0, ignore_eos=True,
                                                         stop=[stop], include_stop_str_in_output=True))[0]
    assert kept.outputs[0].text == text[:13]


def test_eos_and_stop_token_ids_and_min_tokens(llm):
    free = llm.generate("Hello", SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0].outputs[0]
    t = free.token_ids
    out = llm.generate("Hello", SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[t[3]]))[0].outputs[0]
    first = t.index(t[3])
    assert out.token_ids == t[:first + 1] and out.stop_reason == t[3] and out.finish_reason == "stop"
    later = [i for i, x in enumerate(t) if x == t[3] and i >= 8]
    out = llm.generate("Hello", SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[t[3]],
                                               min_tokens=8))[0].outputs[0]
    assert len(out.token_ids) == (later[0] + 1 if later else 20)


def test_bad_requests_raise_clear_errors(llm):
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate({"prompt_token_ids": [5] * 5000})
    with pytest.raises(ValueError, match=r"\[0, 512\)"):
        llm.generate({"prompt_token_ids": [5, 9999]})
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_on_the_cpu(tiny_model, dtype):
    llm16 = LLM(tiny_model["model_dir"], dtype=dtype, max_num_batched_tokens=32)
    assert str(llm16.engine.runner.kv_caches[0][0].dtype) == f"torch.{dtype}"
    prompts = [{"prompt_token_ids": [1] + list(range(40, 40 + n))} for n in (3, 30, 70)]
    outs = llm16.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1))
    for out in outs:
        comp = out.outputs[0]
        assert len(comp.token_ids) == 8
        assert all(-1e4 < lp.logprob <= 0 for entry in comp.logprobs for lp in entry.values())
