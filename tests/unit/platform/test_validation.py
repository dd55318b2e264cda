"""Request limits give a 400 naming the parameter, before the engine sees anything."""

from __future__ import annotations

import pytest

from loraplex.platform.errors import ApiError
from loraplex.platform.inference import schemas as s
from loraplex.platform.inference.validation import (
    Limits,
    check_max_tokens,
    check_n,
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
