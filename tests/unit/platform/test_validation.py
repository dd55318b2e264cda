"""Request limits give a 400 naming the parameter, before the engine sees anything."""

from __future__ import annotations

import pytest

from loraplex.engine.sampling_params import SamplingParams
from loraplex.platform.errors import ApiError
from loraplex.platform.inference import schemas as s
from loraplex.platform.inference.validation import (
    Limits,
    check_max_tokens,
    check_n,
    check_token_restrictions,
    normalize_stop,
    sampling_params,
)

LIMITS = Limits(max_tokens_limit=4096, max_n=16, max_stop_sequences=8, max_model_len=512)


def _param(fn, *args, **kw) -> str:
    with pytest.raises(ApiError) as err:
        fn(*args, **kw)
    assert err.value.status_code == 400
    return err.value.param


def test_n_limits():
    assert check_n(None, 1, LIMITS) == 1
    assert check_n(16, 1, LIMITS) == 16
    assert _param(check_n, 10000, 1, LIMITS) == "n"
    assert _param(check_n, 0, 1, LIMITS) == "n"
    assert _param(check_n, 9, 2, LIMITS) == "n"


def test_stop_limits():
    assert normalize_stop("x", LIMITS) == ["x"]
    assert normalize_stop(None, LIMITS) == []
    assert _param(normalize_stop, [str(i) for i in range(500)], LIMITS) == "stop"
    assert _param(normalize_stop, [""], LIMITS) == "stop"
    assert _param(normalize_stop, ["x" * 1000], LIMITS) == "stop"


def test_max_tokens_and_context():
    assert check_max_tokens(None, 100, LIMITS, "max_tokens", "prompt") == 412
    assert check_max_tokens(10, 100, LIMITS, "max_tokens", "prompt") == 10
    assert _param(check_max_tokens, 10**9, 100, LIMITS, "max_tokens", "prompt") == "max_tokens"
    assert _param(check_max_tokens, 0, 100, LIMITS, "max_tokens", "prompt") == "max_tokens"
    assert _param(check_max_tokens, 500, 100, LIMITS, "max_tokens", "prompt") == "max_tokens"
    assert _param(check_max_tokens, 5, 512, LIMITS, "max_tokens", "messages") == "messages"


@pytest.mark.parametrize("field,value", [("temperature", -1.0), ("temperature", 3.0), ("top_p", 1.5),
                                         ("presence_penalty", 5.0), ("top_k", -5), ("seed", 2**70)])
def test_sampling_fields_name_the_param(field, value):
    req = s.CompletionRequest(model="m", prompt="hi", **{field: value})
    assert _param(sampling_params, req, n=1, max_tokens=5, stop=[], logprobs=None) == field


def test_sampling_params_built():
    req = s.CompletionRequest(model="m", prompt="hi", temperature=0.0, top_p=0.5, seed=7)
    p = sampling_params(req, n=2, max_tokens=5, stop=["\n"], logprobs=2)
    assert (p.n, p.temperature, p.top_p, p.seed, p.max_tokens, p.stop, p.logprobs) == (2, 0.0, 0.5, 7, 5, ["\n"], 2)


def test_token_restrictions_reach_the_sampling_params():
    req = s.ChatCompletionRequest(model="m", messages=[], allowed_token_ids=[3, 4], bad_words=["x"],
                                  logit_bias={"5": -2.5})
    check_token_restrictions(req, 512)
    p = sampling_params(req, n=1, max_tokens=5, stop=[], logprobs=None)
    assert (p.allowed_token_ids, p.bad_words, p.logit_bias) == ([3, 4], ["x"], {5: -2.5})
    none = sampling_params(s.CompletionRequest(model="m", prompt="hi", logit_bias={}, bad_words=[]), n=1,
                           max_tokens=5, stop=[], logprobs=None)
    assert none.sampler_flags == SamplingParams(max_tokens=5).sampler_flags  # the no-op forms cost nothing


@pytest.mark.parametrize("field, value, limit", [
    ("bad_words", ["w"] * 65, "64"), ("bad_words", ["w" * 257], "256"), ("allowed_token_ids", [1] * 513, "512"),
    ("logit_bias", {str(i): 1.0 for i in range(513)}, "512"),
])
def test_token_restriction_sizes_name_the_field_and_the_limit(field, value, limit):
    req = s.CompletionRequest(model="m", prompt="hi", **{field: value})
    with pytest.raises(ApiError) as err:
        check_token_restrictions(req, 512)
    assert err.value.status_code == 400 and err.value.param == field and limit in err.value.message


@pytest.mark.parametrize("field, value", [("allowed_token_ids", []), ("allowed_token_ids", [-1]),
                                          ("logit_bias", {"5": 101.0}), ("logit_bias", {"x": 1.0}),
                                          ("bad_words", [""])])
def test_token_restriction_values_name_the_field(field, value):
    req = s.CompletionRequest(model="m", prompt="hi", **{field: value})
    assert _param(sampling_params, req, n=1, max_tokens=5, stop=[], logprobs=None) == field
