"""vLLM's token restrictions: ``allowed_token_ids`` (only these may be sampled), ``bad_words`` (a word's token
sequence is never completed) and OpenAI's ``logit_bias`` (added to the logits). Sampler masks row by row (an
output token still in flight decides on the device), validation naming the field and the limit, and the
engine's tokens obeying them."""

from __future__ import annotations

import math

import pytest
import torch

from loraplex import LLM, SamplingParams
from loraplex.engine.sampler import Sampler, SampleRow
from loraplex.engine.sampling_params import SAMPLE_BAD_WORDS, SAMPLE_LOGIT_BIAS, SamplingParamsError

CPU = torch.device("cpu")
GREEDY = SamplingParams(temperature=0)


def _logits(rows: int = 1, vocab: int = 12, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 2


def _row(params: SamplingParams, output=(), bad=(), inflight_src=None) -> SampleRow:
    return SampleRow(params, 0, len(output), [1], list(output), inflight_src, [list(w) for w in bad])


def _never_called():
    raise AssertionError("per-row details were built for a batch that needs none")


# ---- the sampler ------------------------------------------------------------------------------------------


def test_allowed_token_ids_restrict_greedy_and_random_rows_and_logprobs_stay_raw():
    logits = _logits()
    order = logits[0].argsort(descending=True).tolist()
    allowed = [order[3], order[5], order[7]]  # not the argmax: the restriction must move the choice
    s = Sampler(CPU, seed=1)
    params = SamplingParams(temperature=0, allowed_token_ids=allowed, logprobs=1)
    out = s.sample(logits, [params], _never_called)  # from the params alone: no per-row details
    assert out.token_ids.tolist() == [order[3]]
    assert out.logprobs.item() == pytest.approx(torch.log_softmax(logits, -1)[0, order[3]].item())
    assert out.ranks.item() == 4  # rank in the raw distribution
    many = logits.repeat(3000, 1)
    drawn = s.sample(many, [SamplingParams(temperature=1.5, allowed_token_ids=allowed)] * 3000, _never_called)
    assert set(drawn.token_ids.tolist()) == set(allowed)  # every allowed token drawn, nothing else


def test_logit_bias_is_added_before_sampling_and_cannot_undo_allowed_token_ids():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    s = Sampler(CPU)

    def greedy(**kw) -> int:
        params = SamplingParams(temperature=0, **kw)
        return s.sample(logits, [params], _never_called).token_ids.item()

    assert greedy() == 0
    assert greedy(logit_bias={3: 3.5}) == 3  # 0 + 3.5 > 3
    assert greedy(logit_bias={3: 2.5}) == 0  # 2.5 < 3
    assert greedy(logit_bias={0: -1.5}) == 1  # 1.5 < 2
    assert greedy(logit_bias={0: -100, 1: -100}) == 2
    assert greedy(logit_bias={3: 100}, allowed_token_ids=[1, 2]) == 1  # a bias never unbans a token
    # random rows: a -100 bias takes the token out in practice, +100 makes it certain
    many = logits.repeat(2000, 1)
    drawn = s.sample(many, [SamplingParams(temperature=1.0, logit_bias={0: -100, 1: -100})] * 2000, _never_called)
    assert set(drawn.token_ids.tolist()) == {2, 3}
    drawn = s.sample(many, [SamplingParams(temperature=1.0, logit_bias={2: 100})] * 2000, _never_called)
    assert set(drawn.token_ids.tolist()) == {2}


def test_bad_words_ban_a_words_last_token_only_after_its_prefix():
    logits = torch.tensor([[0.0, 5.0, 4.0, 3.0, 2.0, 1.0]])  # greedy order: 1, 2, 3, 4, 5, 0
    s = Sampler(CPU)
    p = SamplingParams(temperature=0, bad_words=["w"])  # the words' ids come with the rows

    def greedy(output, *words) -> int:
        return s(logits, [_row(p, output, words)]).token_ids.item()

    assert greedy([], [1]) == 2  # a one-token word is always banned
    assert greedy([], [1], [2]) == 3
    assert greedy([7, 8], [8, 1]) == 2  # the output ends with the prefix [8]: 1 would complete the word
    assert greedy([8, 7], [8, 1]) == 1  # it does not
    assert greedy([6, 7, 8], [7, 8, 1]) == 2  # a longer prefix
    assert greedy([6, 9, 8], [7, 8, 1]) == 1  # only its last token matches
    assert greedy([8], [7, 8, 1]) == 1  # the output is shorter than the prefix (the prompt does not count)
    assert greedy([], [8, 1]) == 1
    assert greedy([8, 7], [8, 1], [7, 1], [7, 2]) == 3  # several words, each on its own prefix
    # a batch mixing a bad-words row with a plain greedy row: only the first moves
    both = s(logits.repeat(2, 1), [_row(p, [8], [[8, 1]]), _row(GREEDY, [8])])
    assert both.token_ids.tolist() == [2, 1]


def test_a_bad_words_prefix_ending_in_the_token_in_flight_is_decided_on_the_device():
    """Overlapped steps: the output's newest token is a placeholder on the host and the real one sits in the
    previous step's device tokens (``inflight_src``); a prefix ending there bans the word's last token exactly
    when the in-flight token matches, as if the host had it."""
    logits = torch.tensor([[0.0, 5.0, 4.0, 3.0, 2.0, 1.0]])  # greedy order: 1, 2, 3, 4, 5, 0
    s = Sampler(CPU)
    p = SamplingParams(temperature=0, bad_words=["w"])
    inflight = torch.tensor([9, 8, 7])
    words = ([6, 8, 1], [8, 2], [7, 1], [3])
    cases = [  # (output with its real newest token, index of that token in ``inflight``, greedy choice)
        ([6, 8], 1, 4),  # [6, 8, 1] and [8, 2] match, [3] always: 1, 2 and 3 banned
        ([5, 8], 1, 1),  # the in-flight token matches [6, 8, 1]'s but the host's part does not: only 2 banned
        ([6, 7], 2, 2),
        ([6, 9], 0, 1),
        ([7], 2, 2),  # a prefix that is the in-flight token alone
        ([8], 1, 1),  # [6, 8, 1]'s prefix is longer than the output
    ]
    for output, src, want in cases:
        late_rows = [_row(p, output[:-1] + [-1], words, src)]
        late = s.sample(logits, [p], lambda: late_rows, None, inflight)  # noqa: B023 (called at once)
        known = s(logits, [_row(p, output[:-1] + [inflight[src].item()], words)])
        assert late.token_ids.tolist() == known.token_ids.tolist() == [want], (output, src)
    # the mixed batch of an overlapped step: in-flight and host-known rows side by side
    rows = [_row(p, [6, -1], words, 1), _row(p, [6, 8], words), _row(p, [6, -1], words, 0)]
    out = s.sample(logits.repeat(3, 1), [p] * 3, lambda: rows, None, inflight)
    assert out.token_ids.tolist() == [4, 4, 1]


def test_flags_mark_only_rows_that_need_the_work():
    plain = SamplingParams(temperature=0)
    assert plain.sampler_flags == 0
    assert SamplingParams(temperature=0, logit_bias={}, bad_words=[]).sampler_flags == 0  # the no-op forms
    assert SamplingParams(temperature=0, allowed_token_ids=[3]).sampler_flags == SAMPLE_LOGIT_BIAS
    assert SamplingParams(temperature=0, logit_bias={3: 1.0}).sampler_flags == SAMPLE_LOGIT_BIAS
    assert SamplingParams(temperature=0, bad_words=["x"]).sampler_flags == SAMPLE_BAD_WORDS


# ---- validation -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("field, value, needle", [
    ("allowed_token_ids", [], "empty"),
    ("allowed_token_ids", [3, -1], ">= 0"),
    ("allowed_token_ids", [3, 1.5], "integer"),
    ("allowed_token_ids", [True], "integer"),
    ("allowed_token_ids", 3, "list"),
    ("logit_bias", {5: 101}, "[-100, 100]"),
    ("logit_bias", {5: -100.5}, "[-100, 100]"),
    ("logit_bias", {5: math.nan}, "[-100, 100]"),
    ("logit_bias", {5: "1"}, "number"),
    ("logit_bias", {"abc": 1}, "token id"),
    ("logit_bias", {"\u00b2": 1}, "token id"),
    ("logit_bias", {-3: 1}, ">= 0"),
    ("logit_bias", {True: 1}, "token id"),
    ("logit_bias", [5, 1], "object"),
    ("bad_words", "word", "list"),
    ("bad_words", ["ok", ""], "empty"),
    ("bad_words", ["   "], "empty"),
    ("bad_words", [5], "string"),
])
def test_bad_values_name_the_field_and_the_limit(field, value, needle):
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(**{field: value})
    assert err.value.param == field and needle in str(err.value), str(err.value)


def test_openai_string_keys_of_logit_bias_are_token_ids():
    p = SamplingParams(logit_bias={"5": 1, 7: -2.5})
    assert p.logit_bias == {5: 1.0, 7: -2.5}
    assert SamplingParams(bad_words=None).bad_words == []


def test_bad_words_are_encoded_with_and_without_a_leading_space_as_vllm_does():
    """The bare word (leading spaces stripped) always; the spaced form only when it is another token sequence of
    the same length (a tokenizer that spells the space as a token of its own would otherwise ban ' ' + word)."""
    vocab = {"hello": [1, 2], " hello": [3, 2], "x": [5], " x": [6, 5], "y": [7], " y": [7], "ab": [8, 9],
             " ab": [10, 8, 9]}
    p = SamplingParams(bad_words=["hello", "x", "y", "  ab"])
    assert p.bad_words_token_ids(vocab.__getitem__) == [[1, 2], [3, 2], [5], [7], [8, 9]]


# ---- through the engine ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(tiny_model["model_dir"], dtype="float32", seed=5)


PROMPTS = [{"prompt_token_ids": [1] + list(range(40 + 7 * i, 70 + 7 * i))} for i in range(4)]


def _contains(seq: list[int], word: list[int]) -> bool:
    return any(seq[i:i + len(word)] == word for i in range(len(seq) - len(word) + 1))


def encode_bad_words(tok, *words) -> list[list[int]]:
    return SamplingParams(bad_words=list(words)).bad_words_token_ids(lambda s: tok.encode(s, add_special_tokens=False))


def two_token_word(tok, outputs: list[list[int]]) -> tuple[str, list[int]]:
    """A word the outputs contain as two tokens, as text whose bad-words encoding gives those tokens back."""
    return next((w, [a, b]) for seq in outputs for a, b in zip(seq, seq[1:])
                for w in [tok.decode([a, b])] if w.strip() and [a, b] in encode_bad_words(tok, w))


def test_generated_tokens_obey_allowed_token_ids(llm):
    allowed = [5, 77, 120, 300, 301]
    outs = llm.generate(PROMPTS, [SamplingParams(max_tokens=24, temperature=t, seed=i, allowed_token_ids=allowed)
                                  for i, t in enumerate((0.0, 0.7, 1.0, 1.5))])
    for out in outs:
        tokens = out.outputs[0].token_ids
        assert len(tokens) == 24 and set(tokens) <= set(allowed), tokens  # never EOS either (not allowed)
    plain = llm.generate(PROMPTS[2], SamplingParams(max_tokens=24, temperature=1.0, seed=2, ignore_eos=True))
    assert not set(plain[0].outputs[0].token_ids) <= set(allowed)  # the restriction did something


def test_generated_tokens_never_complete_a_bad_word(llm):
    tok = llm.get_tokenizer()
    plain = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    probe = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, plain)]
    # a two-token word the greedy outputs produce, as text whose encoding gives those two tokens back
    word, ids = two_token_word(tok, probe)
    # and a token of the first output as a one-token word
    single, first = next((w, t) for t in probe[0] for w in [tok.decode([t])]
                         if w.strip() and [t] in encode_bad_words(tok, w))
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, bad_words=[word, single])
    banned = encode_bad_words(tok, word, single)
    assert ids in banned and [first] in banned
    assert any(_contains(seq, ids) for seq in probe)  # the probe does produce it
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    for seq in got:
        assert len(seq) == 30 and not any(_contains(seq, w) for w in banned), (seq, banned)
    assert got != probe
    # random sampling as well (each row with its own seed)
    rnd = [SamplingParams(max_tokens=30, temperature=1.0, seed=i, ignore_eos=True, bad_words=[word, single])
           for i in range(4)]
    for out in llm.generate(PROMPTS, rnd):
        assert not any(_contains(out.outputs[0].token_ids, w) for w in banned)


def test_ids_outside_the_vocabulary_or_banning_every_allowed_token_are_refused_naming_the_field(llm):
    for kw, field in ((dict(allowed_token_ids=[5, 512]), "allowed_token_ids"), (dict(logit_bias={600: 1}), "logit_bias")):
        with pytest.raises(SamplingParamsError) as err:
            llm.generate(PROMPTS[0], SamplingParams(max_tokens=2, **kw))
        assert err.value.param == field and "[0, 512)" in str(err.value), str(err.value)
    tok = llm.get_tokenizer()
    q, z = (tok.encode(c, add_special_tokens=False)[0] for c in "qz")
    with pytest.raises(SamplingParamsError, match="nothing could be sampled") as err:  # the ban leaves no token
        llm.generate(PROMPTS[0], SamplingParams(max_tokens=2, allowed_token_ids=[q, z], bad_words=["q", "z"]))
    assert err.value.param == "bad_words"
    assert not llm.engine.has_unfinished_requests()
    ok = llm.generate(PROMPTS[0], SamplingParams(max_tokens=2, temperature=0, allowed_token_ids=[q, z],
                                                 bad_words=["q", "zzz"]))
    assert ok[0].outputs[0].token_ids == [z, z]  # "zzz" would be completed only by a third z
    ok = llm.generate(PROMPTS[0], SamplingParams(max_tokens=2, temperature=0, allowed_token_ids=[511]))
    assert ok[0].outputs[0].token_ids == [511, 511]


def test_the_samplers_arrays_of_a_request_live_as_long_as_its_params():
    import gc

    s = Sampler(CPU)
    params = SamplingParams(temperature=0, allowed_token_ids=[4, 2, 4], logit_bias={1: 0.5})
    for _ in range(3):
        assert s.sample(_logits(), [params], _never_called).token_ids.item() in (2, 4)
    assert len(s._bias_arrays) == 1
    del params
    gc.collect()
    assert not s._bias_arrays
