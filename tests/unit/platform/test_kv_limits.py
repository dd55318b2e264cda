"""Token buckets, pub/sub and TTLs of the in-process KV; rate limiter headers; admission cap."""

from __future__ import annotations

import pytest

from loraplex.platform.auth import Principal
from loraplex.platform.errors import ApiError
from loraplex.platform.kv import LocalKV
from loraplex.platform.limits import Admission, RateLimiter, RequestSize
from loraplex.settings import Settings


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


async def test_bucket_refills_with_time_and_refunds_cap_at_capacity():
    clock = Clock()
    kv = LocalKV(clock=clock)
    for i in range(3):
        r = await kv.token_bucket("b", capacity=3, refill_per_s=1.0)
        assert r.allowed and r.remaining == 2 - i
    r = await kv.token_bucket("b", capacity=3, refill_per_s=1.0)
    assert not r.allowed and r.retry_after_s == pytest.approx(1.0) and r.reset_s == pytest.approx(3.0)
    clock.t += 0.5
    assert not (await kv.token_bucket("b", 3, 1.0)).allowed
    clock.t += 0.5
    assert (await kv.token_bucket("b", 3, 1.0)).allowed
    r = await kv.token_bucket("b", 3, 1.0, cost=-100, force=True)
    assert r.remaining == 3  # a refund never overfills
    r = await kv.token_bucket("b", 3, 1.0, cost=10, force=True)
    assert r.allowed and r.remaining == -7  # forced charge goes into debt


async def test_ttl_and_pubsub():
    clock = Clock()
    kv = LocalKV(clock=clock)
    await kv.set("k", "v", ttl_s=2)
    assert await kv.get("k") == "v"
    clock.t += 2.1
    assert await kv.get("k") is None
    got: list[str] = []
    sub = await kv.subscribe("ch", got.append)
    await kv.publish("ch", "hello")
    await kv.publish("other", "nope")
    await sub.close()
    await kv.publish("ch", "after close")
    assert got == ["hello"]


def _principal(rpm=None, tpm=None) -> Principal:
    return Principal("t1", "acme", "k1", frozenset({"inference"}), rpm, tpm)


async def test_rate_limiter_requests_then_tokens_with_headers():
    kv = LocalKV()
    limiter = RateLimiter(kv, Settings(default_requests_per_minute=2, default_tokens_per_minute=100))
    p = _principal()
    g = await limiter.admit(p, 30)
    assert g.headers["x-ratelimit-limit-requests"] == "2"
    assert g.headers["x-ratelimit-remaining-requests"] == "1"
    assert g.headers["x-ratelimit-limit-tokens"] == "100"
    assert g.headers["x-ratelimit-remaining-tokens"] == "70"
    await limiter.settle(p, g, 10)  # used only 10 of 30: 20 come back
    g2 = await limiter.admit(p, 1)
    assert g2.headers["x-ratelimit-remaining-tokens"] == "89"
    with pytest.raises(ApiError) as err:
        await limiter.admit(p, 1)
    e = err.value
    assert e.status_code == 429 and e.code == "rate_limit_exceeded" and int(e.headers["Retry-After"]) >= 1
    assert e.headers["x-ratelimit-remaining-requests"] == "0"


async def test_token_limit_429_refunds_the_request_and_overrides_apply():
    kv = LocalKV()
    limiter = RateLimiter(kv, Settings(default_requests_per_minute=100, default_tokens_per_minute=1000))
    p = _principal(rpm=5, tpm=50)
    await limiter.admit(p, 50)
    with pytest.raises(ApiError) as err:
        await limiter.admit(p, 10)
    assert "50 tokens per minute" in err.value.message
    assert err.value.headers["x-ratelimit-limit-requests"] == "5"
    # the refused request did not use up a request slot
    assert err.value.headers["x-ratelimit-remaining-requests"] == "3"
    r = await kv.token_bucket("rl:req:t1", 5, 5 / 60)
    assert r.remaining == pytest.approx(3, abs=0.01)


def test_admission_cap():
    a = Admission(2)
    a.acquire()
    a.acquire()
    with pytest.raises(ApiError) as err:
        a.acquire()
    assert err.value.status_code == 503 and err.value.headers["Retry-After"] == "1"
    a.release()
    a.acquire()
    assert a.in_flight == 2


def _size(**kw) -> RequestSize:
    base = dict(model="demo-model", prompt_tokens=2, max_tokens=300, sequences=1, default_budget=False, min_budget=1,
                max_tokens_param="max_tokens", prompt_param="prompt")
    return RequestSize(**{**base, **kw})


async def test_a_request_larger_than_the_token_limit_is_refused_before_any_bucket_is_touched():
    """OpenAI's "Request too large": 429 rate_limit_exceeded naming the limit and the amount, how to fit, and
    x-should-retry: false without Retry-After (waiting cannot help); neither bucket loses anything."""
    kv = LocalKV(clock=Clock())
    limiter = RateLimiter(kv, Settings(default_requests_per_minute=5, default_tokens_per_minute=1000))
    p = _principal(tpm=200)
    with pytest.raises(ApiError) as err:
        limiter.fit(p, _size())
    e = err.value
    assert (e.status_code, e.type, e.code, e.param) == (429, "rate_limit_error", "rate_limit_exceeded", "max_tokens")
    assert e.message.startswith("Request too large for demo-model: Limit 200 tokens per minute, Requested 302 ")
    assert "Lower max_tokens to at most 198." in e.message
    assert e.headers == {"x-should-retry": "false"}
    assert (await kv.token_bucket("rl:req:t1", 5, 5 / 60, 0)).remaining == 5
    assert (await kv.token_bucket("rl:tok:t1", 200, 200 / 60, 0)).remaining == 200
    # exactly the limit fits, and runs with its own max_tokens
    assert limiter.fit(p, _size(max_tokens=198)) == 198


async def test_too_large_names_n_and_the_prompt_when_lowering_max_tokens_is_not_enough():
    limiter = RateLimiter(LocalKV(), Settings())
    p = _principal(tpm=100)
    with pytest.raises(ApiError) as err:
        limiter.fit(p, _size(prompt_tokens=10, max_tokens=20, sequences=6, max_tokens_param="max_completion_tokens"))
    e = err.value
    assert e.param == "max_completion_tokens" and "Requested 130 " in e.message
    assert "Lower max_completion_tokens to at most 15 or lower n." in e.message
    with pytest.raises(ApiError) as err:
        limiter.fit(p, _size(prompt_tokens=100, max_tokens=1, prompt_param="messages"))
    assert err.value.param == "messages" and "Shorten messages: this prompt leaves room for 0" in err.value.message


def test_a_default_budget_is_cut_to_the_limit_and_refused_only_when_its_least_does_not_fit():
    """A chat request without max_tokens would get the rest of the context (thousands of tokens): on a small plan
    that budget is cut to what the whole bucket holds, instead of making every such request too large."""
    limiter = RateLimiter(LocalKV(), Settings())
    p = _principal(tpm=200)
    chat = dict(default_budget=True, max_tokens=4000, max_tokens_param="max_tokens", prompt_param="messages")
    assert limiter.fit(p, _size(prompt_tokens=50, **chat)) == 150
    assert limiter.fit(p, _size(prompt_tokens=50, sequences=3, **chat)) == 50
    assert limiter.fit(p, _size(prompt_tokens=50, **{**chat, "max_tokens": 20})) == 20  # less context is left
    assert limiter.fit(_principal(tpm=200_000), _size(prompt_tokens=50, **chat)) == 4000
    with pytest.raises(ApiError) as err:  # min_tokens is the least it may be cut to
        limiter.fit(p, _size(prompt_tokens=50, min_budget=160, **chat))
    e = err.value
    assert e.status_code == 429 and e.param == "messages" and "Requested 210 " in e.message
    assert "Shorten messages or lower min_tokens" in e.message


async def test_settling_refunds_the_unused_charge_and_never_takes_more():
    kv = LocalKV(clock=Clock())
    limiter = RateLimiter(kv, Settings(default_tokens_per_minute=200))
    p = _principal()
    grant = await limiter.admit(p, 150)
    await limiter.settle(p, grant, 40)
    assert (await kv.token_bucket("rl:tok:t1", 200, 200 / 60, 0)).remaining == 160
    grant = await limiter.admit(p, 100)
    await limiter.settle(p, grant, 130)  # more than charged: the bucket does not go into debt for it
    assert (await kv.token_bucket("rl:tok:t1", 200, 200 / 60, 0)).remaining == 60
