"""Token buckets, pub/sub and TTLs of the in-process KV; rate limiter headers; admission cap."""

from __future__ import annotations

import pytest

from loraplex.platform.auth import Principal
from loraplex.platform.errors import ApiError
from loraplex.platform.kv import LocalKV
from loraplex.platform.limits import Admission, RateLimiter
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
