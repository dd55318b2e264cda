"""Text, stop strings, finish reasons and request validation through the offline API."""

from __future__ import annotations

import math

import pytest

from loraplex import LLM, SamplingParams
from loraplex.engine.sampling_params import SamplingParamsError


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
    out = llm.generate("Hello", SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[t[3]],
                                               min_tokens=8))[0].outputs[0]
    # the stop token is not sampled before min_tokens (vLLM bans it), then ends the sequence where it comes
    assert t[3] not in out.token_ids[:8] and out.token_ids[:3] == t[:3] and out.token_ids[3] != t[3]
    assert t[3] not in out.token_ids[:-1]
    assert (out.finish_reason, out.token_ids[-1]) == ("stop", t[3]) or (out.finish_reason, len(out.token_ids)) == ("length", 20)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_min_tokens_bans_eos_and_stop_tokens_until_reached(tiny_model, async_scheduling):
    """EOS (unless ignore_eos) and stop_token_ids cannot be sampled before min_tokens output tokens, as in vLLM;
    here both are favoured by +100 logit_bias, so without min_tokens they would come first."""
    llm = LLM(tiny_model["model_dir"], dtype="float32", async_scheduling=async_scheduling)
    eos = llm.get_tokenizer().eos_token_id
    free = llm.generate("Hello", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].outputs[0].token_ids
    stop = free[1]
    cases = [(dict(logit_bias={eos: 100.0}), eos), (dict(logit_bias={stop: 100.0}, stop_token_ids=[stop]), stop)]
    for kw, ender in cases:
        first = llm.generate("Hello", SamplingParams(max_tokens=12, temperature=0, **kw))[0].outputs[0]
        assert first.token_ids == [ender] and first.finish_reason == "stop"
        for min_tokens in (1, 4):
            outs = llm.generate(["Hello", "The river"], SamplingParams(max_tokens=12, temperature=0, min_tokens=min_tokens,
                                                                       **kw))
            for o in outs:
                ids = o.outputs[0].token_ids
                assert len(ids) == min_tokens + 1 and ids[-1] == ender and ender not in ids[:-1], (kw, ids)
                assert o.outputs[0].finish_reason == "stop"
    # ignore_eos: EOS is not what ends the sequence, so min_tokens leaves it alone
    out = llm.generate("Hello", SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, min_tokens=3,
                                               logit_bias={eos: 100.0}))[0].outputs[0]
    assert out.token_ids == [eos] * 5


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


@pytest.mark.parametrize("field, value", [
    ("top_k", 2.5), ("logprobs", 1.5), ("prompt_logprobs", 2.5), ("seed", "x"), ("max_tokens", 2.5),
    ("min_tokens", 1.5), ("stop_token_ids", ["a"]), ("temperature", "1"), ("top_p", None), ("ignore_eos", "no"),
    ("n", True),
])
def test_mistyped_sampling_param_names_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field}: "):
        SamplingParams(**{field: value})


def test_bad_prompt_token_ids_are_refused_and_leave_the_engine_usable(llm):
    want = llm.generate("Hello", SamplingParams(max_tokens=4, temperature=0))[0].outputs[0].token_ids
    for bad in ([5, 1.5], [5, "7"], [5, None], [5, True]):
        with pytest.raises(ValueError, match="prompt token ids"):
            llm.generate(["Hello", {"prompt_token_ids": bad}], SamplingParams(max_tokens=4, temperature=0))
        assert not llm.engine.has_unfinished_requests()
    assert llm.generate("Hello", SamplingParams(max_tokens=4, temperature=0))[0].outputs[0].token_ids == want
    # numpy integers are integers
    np = pytest.importorskip("numpy")
    ids = llm.get_tokenizer().encode("Hello")
    got = llm.generate({"prompt_token_ids": np.array(ids)}, SamplingParams(max_tokens=4, temperature=0))[0]
    assert got.outputs[0].token_ids == want and got.prompt_token_ids == ids


def test_a_failing_step_ends_the_calls_requests_and_not_the_engine(llm, monkeypatch):
    want = llm.generate(["Hello", "A"], SamplingParams(max_tokens=4, temperature=0))
    calls = {"n": 0}
    launch = llm.engine.runner.launch

    def failing_launch(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected step failure")
        return launch(*args, **kwargs)

    monkeypatch.setattr(llm.engine.runner, "launch", failing_launch)
    with pytest.raises(RuntimeError, match="injected"):
        llm.generate(["Hello", "A"], SamplingParams(max_tokens=4, temperature=0))
    assert not llm.engine.has_unfinished_requests()
    monkeypatch.undo()
    again = llm.generate(["Hello", "A"], SamplingParams(max_tokens=4, temperature=0))
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in want]
    llm.engine.block_manager.check_invariants([])


def test_take_back_removes_a_request_as_if_never_added(llm):
    """A request taken back before any step reports nothing, frees its id at once, and costs no work."""
    engine = llm.engine
    params = SamplingParams(n=3, max_tokens=2, temperature=1.0, seed=1, ignore_eos=True)
    engine.add_request("tb", [1, 5, 6, 7], params)
    engine.take_back("tb")
    assert not engine.has_unfinished_requests()
    computed = engine.counters["num_computed_prompt_tokens"]
    assert engine.step() == []
    engine.add_request("tb", [1, 5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True))  # the id is free
    deltas = []
    while engine.has_unfinished_requests():
        deltas += engine.step()
    assert [d.index for d in deltas if d.finished] == [0]  # only the new request's one sample
    assert engine.counters["num_computed_prompt_tokens"] - computed == 4


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_temperature_that_is_not_a_finite_number_is_refused_naming_the_field(value):
    # a NaN temperature passed `< 0` and sampled token 0 at every step (no error); inf passed too
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(temperature=value)
    assert err.value.param == "temperature" and "finite" in str(err.value), str(err.value)


@pytest.mark.parametrize("kwargs, needle", [
    ({"lora_request": "path/to/adapter"}, "lora_request"),
    ({"lora_request": [None, "path/to/adapter"]}, "lora_request"),
    ({"sampling_params": {"max_tokens": 2}}, "sampling_params"),
    ({"priority": ["high", 0]}, "priority"),
    ({"priority": [1.5, 0]}, "priority"),
    ({"priority": 3}, "priority"),
])
def test_arguments_of_the_wrong_type_are_refused_and_leave_the_llm_usable(llm, kwargs, needle):
    """A string lora_request (a path instead of a LoRARequest) used to be half added: the engine kept the
    request, and every later generate() of this LLM failed with "'str' object has no attribute 'lora_int_id'"."""
    prompts = ["Hello", "A"]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0))]
    with pytest.raises((TypeError, ValueError)) as err:
        llm.generate(prompts, **{"sampling_params": SamplingParams(max_tokens=4, temperature=0), **kwargs})
    assert needle in str(err.value), str(err.value)
    assert not llm.engine.has_unfinished_requests()
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0))]
    assert got == want


def test_a_sampling_params_changed_between_calls_samples_with_its_new_values(llm):
    """vLLM code often reuses one SamplingParams and sets a field between calls; the sampler's flags were cached
    on the object at its first use, so temperature 0 -> 1 kept decoding greedily, and a value set afterwards was
    never validated."""
    prompts = ["Hello", "A", "The"]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    greedy = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    params.temperature, params.seed = 1.0, 5
    sampled = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    fresh = SamplingParams(max_tokens=6, temperature=1.0, seed=5, ignore_eos=True)
    assert sampled == [o.outputs[0].token_ids for o in llm.generate(prompts, fresh)] != greedy
    params.logit_bias = {5: 100.0}  # the sampler's arrays follow too
    assert all(o.outputs[0].token_ids == [5] * 6 for o in llm.generate(prompts, params))
    params.temperature = -1.0
    with pytest.raises(SamplingParamsError, match="^temperature: "):
        llm.generate(prompts, params)
    assert not llm.engine.has_unfinished_requests()


def _greedy(llm, max_tokens: int, **kw):
    return llm.generate("Hello", SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kw))[0].outputs[0]


def _visible_new_token(llm, token_ids: list[int]) -> int:
    """The index of the first token that appears there for the first time and adds text of its own."""
    text_of = [_greedy(llm, k).text for k in range(1, len(token_ids) + 1)]
    return next(k for k in range(1, len(token_ids)) if token_ids[k] not in token_ids[:k] and text_of[k] != text_of[k - 1])


def test_the_stop_token_that_ends_a_sequence_adds_no_text(llm):
    """vLLM keeps the stop token's id in token_ids but not its text (unless include_stop_str_in_output): its
    text was left at the end of the output."""
    t = _greedy(llm, 20).token_ids
    k = _visible_new_token(llm, t)
    before, with_stop = _greedy(llm, k).text, _greedy(llm, k + 1).text
    out = _greedy(llm, 20, stop_token_ids=[t[k]])
    assert out.token_ids == t[:k + 1] and out.finish_reason == "stop" and out.stop_reason == t[k]
    assert out.text == before != with_stop
    assert _greedy(llm, 20, stop_token_ids=[t[k]], include_stop_str_in_output=True).text == with_stop


def test_eos_that_ends_a_sequence_adds_no_text_even_with_special_tokens_shown(llm):
    tok = llm.get_tokenizer()
    eos = tok.eos_token_id
    assert eos in llm.engine.eos_token_ids
    forced = SamplingParams(max_tokens=5, temperature=0, logit_bias={eos: 100.0}, skip_special_tokens=False)
    out = llm.generate("Hello", forced)[0].outputs[0]
    assert out.token_ids == [eos] and out.finish_reason == "stop" and out.text == ""
    forced.include_stop_str_in_output = True
    assert llm.generate("Hello", forced)[0].outputs[0].text == tok.eos_token


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_no_delta_carries_the_stop_tokens_text(tiny_model, async_scheduling):
    """The HTTP server streams the engine's deltas as they come: the stop token's text must never be sent, and
    the deltas add up to the final text."""
    llm = LLM(tiny_model["model_dir"], dtype="float32", async_scheduling=async_scheduling)
    t = _greedy(llm, 20).token_ids
    k = _visible_new_token(llm, t)
    want = _greedy(llm, k).text
    engine = llm.engine
    engine.add_request("s", llm.get_tokenizer().encode("Hello"),
                       SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop_token_ids=[t[k]]))
    deltas = []
    while engine.has_unfinished_requests():
        deltas += [d for d in engine.step() if d.request_id == "s"]
    assert [i for d in deltas for i in d.token_ids] == t[:k + 1] and deltas[-1].finish_reason == "stop"
    assert "".join(d.text for d in deltas) == want


@pytest.mark.parametrize("kwargs, needle", [
    ({"lora_request": "path/to/adapter"}, "lora_request"),
    ({"lora_request": {"lora_name": "a", "lora_int_id": 1, "lora_path": "p"}}, "lora_request"),
    ({"sampling_params": {"max_tokens": 2}}, "sampling_params"),
    ({"sampling_params": None}, "sampling_params"),
    ({"prompt_token_ids": None}, "prompt_token_ids"),
    ({"prompt_token_ids": "Hello"}, "prompt_token_ids"),
    ({"request_id": 7}, "request_id"),
    ({"priority": "high"}, "priority"),
    ({"priority": 1.5}, "priority"),
    ({"priority": True}, "priority"),
    ({"cache_salt": b"salt"}, "cache_salt"),
    ({"arrival_time": "now"}, "arrival_time"),
    ({"prompt": ["Hello"]}, "prompt"),
])
def test_engine_add_request_refuses_arguments_of_the_wrong_type_and_stays_usable(llm, kwargs, needle):
    """A string lora_request was half added: the request stayed in the scheduler (its error handler read
    ``lora_request.lora_name`` and raised itself), and every later step failed."""
    engine = llm.engine
    ids = llm.get_tokenizer().encode("Hello")
    params = SamplingParams(max_tokens=4, temperature=0)
    want = llm.generate("Hello", params)[0].outputs[0].token_ids
    with pytest.raises((TypeError, ValueError)) as err:
        engine.add_request(**{"request_id": "typed", "prompt_token_ids": ids, "sampling_params": params, **kwargs})
    assert needle in str(err.value), str(err.value)
    assert not engine.has_unfinished_requests()
    engine.add_request("typed", ids, params)  # the id was not taken
    deltas = []
    while engine.has_unfinished_requests():
        deltas += engine.step()
    assert [t for d in deltas for t in d.token_ids] == want
    assert llm.generate("Hello", params)[0].outputs[0].token_ids == want


def _engine_tokens(engine, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> list[int]:
    engine.add_request(request_id, prompt_token_ids, params)
    deltas = []
    while engine.has_unfinished_requests():
        deltas += engine.step()
    return [t for d in deltas if d.request_id == request_id for t in d.token_ids]


def test_engine_add_request_samples_a_changed_sampling_params_with_its_new_values(llm):
    """Like LLM.generate, LLMEngine.add_request reads the params as they are at the call: the sampler's flags
    and bias arrays were cached on the object at its first use (temperature 0 -> 1 kept decoding greedily, a
    logit_bias set or changed later was ignored), and a value set later was never validated."""
    engine = llm.engine
    ids = llm.get_tokenizer().encode("Hello")
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    greedy = _engine_tokens(engine, "p0", ids, params)
    params.temperature, params.seed = 1.0, 5
    fresh = SamplingParams(max_tokens=6, temperature=1.0, seed=5, ignore_eos=True)
    assert _engine_tokens(engine, "p1", ids, params) == _engine_tokens(engine, "p2", ids, fresh) != greedy
    params.logit_bias = {5: 100.0}
    assert _engine_tokens(engine, "p3", ids, params) == [5] * 6
    params.logit_bias = {6: 100.0}
    assert _engine_tokens(engine, "p4", ids, params) == [6] * 6
    params.temperature = -1.0
    with pytest.raises(SamplingParamsError, match="^temperature: "):
        engine.add_request("p5", ids, params)
    assert not engine.has_unfinished_requests()


def test_a_text_prompt_dict_runs_as_its_string_and_other_prompts_name_the_argument(llm):
    """vLLM's ``{"prompt": text}`` (TextPrompt) gives the tokens of the plain string; a prompt that is none of the
    accepted forms (or prompts=None) is refused naming what is accepted, and the LLM stays usable."""
    params = SamplingParams(max_tokens=4, temperature=0)
    want = llm.generate("Hello there", params)[0]
    got = llm.generate([{"prompt": "Hello there"}], params)[0]
    assert got.prompt == "Hello there" and got.prompt_token_ids == want.prompt_token_ids
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    for bad in ([[1, 2, 3]], [{"text": "Hello"}]):
        with pytest.raises(ValueError, match="'prompt_token_ids'.*'prompt'"):
            llm.generate(bad, params)
    with pytest.raises(TypeError, match="prompts: must be"):
        llm.generate(None, params)
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate("Hello there", params)[0].outputs[0].token_ids == want.outputs[0].token_ids


def test_chat_runs_each_conversation_through_the_models_chat_template(llm, tiny_model):
    """vLLM's ``LLM.chat`` (it did not exist): a conversation, or a list of them, gives the tokens of ``generate`` on
    the ids of Hugging Face's ``apply_chat_template`` with the generation prompt."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model["model_dir"])
    first = [{"role": "user", "content": "Hello"}]
    second = [*first, {"role": "assistant", "content": "Hi"}, {"role": "user", "content": "The river"}]
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    want_ids = []
    for conversation in (first, second):
        ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
        want_ids.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    want = llm.generate([{"prompt_token_ids": ids} for ids in want_ids], params)
    got_one = llm.chat(first, params)
    got_two = llm.chat([first, second], params)
    assert len(got_one) == 1 and got_one[0].prompt_token_ids == want_ids[0]
    assert "Hello" in got_one[0].prompt
    assert [o.prompt_token_ids for o in got_two] == want_ids
    assert [o.outputs[0].token_ids for o in got_two] == [o.outputs[0].token_ids for o in want]
    assert got_one[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    with pytest.raises(TypeError, match="messages"):
        llm.chat("Hello", params)


def test_chat_takes_messages_as_the_server_does(llm):
    """Text parts are joined, missing content is "", "developer" is "system"; a role the server refuses, a non-text
    part or a non-dict message is a ValueError naming the message (a Jinja error named nothing)."""
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    plain = llm.chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi\nthere"}], params)
    parts = llm.chat([{"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
                      {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}],
                     params)
    assert parts[0].prompt_token_ids == plain[0].prompt_token_ids
    empty = llm.chat([{"role": "user"}], params)
    assert empty[0].prompt_token_ids == llm.chat([{"role": "user", "content": ""}], params)[0].prompt_token_ids
    for conversation, needle in (([{"role": "foo", "content": "x"}], r"messages\[0\]\.role must be one of"),
                                 ([{"role": "user", "content": [{"type": "image_url"}]}], r"messages\[0\]\.content"),
                                 ([{"role": "user", "content": "x"}, "hi"], r"messages\[1\]")):
        with pytest.raises(ValueError, match=needle):
            llm.chat(conversation, params)
    with pytest.raises(ValueError, match=r"messages\[1\]\[0\]\.role"):
        llm.chat([[{"role": "user", "content": "x"}], [{"role": "nobody", "content": "x"}]], params)
    assert not llm.engine.has_unfinished_requests()


def test_a_prompt_dicts_cache_salt_keeps_its_prefix_cache_apart_and_other_vllm_keys_are_refused(llm):
    """vLLM's prompt dicts may carry ``cache_salt`` (prompts with different salts never share prefix-cache blocks):
    it is honoured. Keys that would change the result under vLLM but mean nothing here (``multi_modal_data``,
    ``prompt_embeds``, ...) or that are no prompt key at all are refused naming the key, not silently dropped."""
    params = SamplingParams(max_tokens=2, temperature=0)
    ids = [1] + list(range(40, 40 + 47))  # several whole blocks
    want = llm.generate({"prompt_token_ids": ids, "cache_salt": "tenant-a"}, params)[0]
    again = llm.generate({"prompt_token_ids": ids, "cache_salt": "tenant-a"}, params)[0]
    assert again.num_cached_tokens > 0
    other = llm.generate({"prompt_token_ids": ids, "cache_salt": "tenant-b"}, params)[0]
    assert other.num_cached_tokens == 0
    assert other.outputs[0].token_ids == again.outputs[0].token_ids == want.outputs[0].token_ids
    text = " ".join(["the river runs"] * 12)
    assert llm.generate({"prompt": text}, params)[0].num_cached_tokens == 0
    assert llm.generate({"prompt": text}, params)[0].num_cached_tokens > 0
    assert llm.generate({"prompt": text, "cache_salt": "tenant-c"}, params)[0].num_cached_tokens == 0
    for bad, key in (({"prompt": "Hello", "multi_modal_data": {"image": object()}}, "multi_modal_data"),
                     ({"prompt_token_ids": [1, 5], "mm_processor_kwargs": {"x": 1}}, "mm_processor_kwargs"),
                     ({"prompt_token_ids": [1, 5], "prompt_embeds": [[0.0]]}, "prompt_embeds"),
                     ({"prompt": "Hello", "cache_salt": 5}, "cache_salt"),
                     ({"prompt": "Hello", "cache_slat": "x"}, "cache_slat")):
        with pytest.raises(ValueError, match=key):
            llm.generate(["Hello", bad], params)
        assert not llm.engine.has_unfinished_requests()
    # vLLM's empty values ask for nothing
    got = llm.generate({"prompt": "Hello", "multi_modal_data": None, "mm_processor_kwargs": {}}, params)[0]
    assert got.outputs[0].token_ids == llm.generate("Hello", params)[0].outputs[0].token_ids


@pytest.mark.parametrize("prompt", [[1], [1, 40], [1, 40, 41, 42]])
def test_prompt_logprobs_have_one_entry_per_prompt_token_the_first_none(llm, prompt):
    """A one-token prompt's prompt_logprobs were None (as if not asked for) instead of [None]."""
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1)
    out = llm.generate({"prompt_token_ids": prompt}, params)[0]
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
    assert out.prompt_logprobs[0] is None and all(prompt[j] in out.prompt_logprobs[j] for j in range(1, len(prompt)))
    assert llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=2))[0].prompt_logprobs is None


@pytest.mark.parametrize("kwargs, key", [({"tokenize": False}, "tokenize"), ({"add_generation_prompt": False},
                                                                             "add_generation_prompt")])
def test_chat_template_kwargs_that_are_parameters_of_the_template_call_are_refused_naming_them(llm, kwargs, key):
    """They reached the tokenizer's apply_chat_template twice: a TypeError from transformers naming neither
    chat_template_kwargs nor the argument to use. Template variables still pass."""
    messages = [{"role": "user", "content": "Hi"}]
    params = SamplingParams(max_tokens=2, temperature=0)
    with pytest.raises(ValueError, match=f"^chat_template_kwargs.{key}: "):
        llm.chat(messages, params, chat_template_kwargs=kwargs)
    with pytest.raises(TypeError, match="^chat_template_kwargs: must be a dict"):
        llm.chat(messages, params, chat_template_kwargs=["x"])
    got = llm.chat(messages, params, chat_template_kwargs={"enable_thinking": False})[0]
    assert got.prompt_token_ids == llm.chat(messages, params)[0].prompt_token_ids
