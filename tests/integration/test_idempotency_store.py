"""The idempotency store on both kv backends: one winner per key (also across Redis clients, i.e. replicas),
stored answers, mismatches, release on 5xx/429, per-tenant scoping, and Redis going away mid-request."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
from litestar import Response

from loraplex.platform import idempotency as idem
from loraplex.platform.errors import ApiError
from loraplex.platform.kv import LocalKV, RedisKV
from tests.integration.tcp_proxy import TcpProxy


@pytest.fixture(params=["local", "redis"])
async def kvs(request):
    """Two kv clients over one store (the same object in-process; two connections to Redis)."""
    if request.param == "local":
        kv = LocalKV()
        yield kv, kv
        return
    url = request.getfixturevalue("redis_url")
    prefix = f"loraplex-idem-test-{time.time_ns()}:"
    a, b = RedisKV(url, prefix=prefix), RedisKV(url, prefix=prefix)
    yield a, b
    await a.close()
    await b.close()


FP, OTHER_FP = idem.fingerprint("POST", "/v1/x", "a" * 64), idem.fingerprint("POST", "/v1/x", "b" * 64)


async def test_concurrent_claims_have_one_winner_and_the_rest_get_409(kvs):
    stores = [idem.IdempotencyStore(kv) for kv in kvs]
    scope = stores[0].scope("tenant-a", "completions", "k1")
    runs = 0

    async def run() -> Response:
        nonlocal runs
        runs += 1
        await asyncio.sleep(0.2)
        return Response({"id": "cmpl-1", "runs": runs})

    results = await asyncio.gather(*[idem.run_once(stores[i % 2], scope, FP, run) for i in range(6)],
                                   return_exceptions=True)
    ok = [r for r in results if isinstance(r, Response)]
    conflicts = [r for r in results if isinstance(r, ApiError)]
    assert runs == 1 and len(ok) == 1
    assert len(conflicts) == 5 and all(e.status_code == 409 and e.code == "idempotency_key_in_use"
                                       for e in conflicts)
    # after it finished: the same request replays the first answer, without running again
    again = await idem.run_once(stores[1], scope, FP, run)
    assert runs == 1 and again.headers[idem.REPLAYED_HEADER] == "true"
    assert msgspec.json.decode(again.content) == {"id": "cmpl-1", "runs": 1}
    with pytest.raises(ApiError) as err:
        await idem.run_once(stores[1], scope, OTHER_FP, run)
    assert err.value.status_code == 422 and err.value.code == "idempotency_key_reused"
    assert err.value.param == idem.HEADER and runs == 1


async def test_a_different_body_while_in_progress_is_422(kvs):
    store = idem.IdempotencyStore(kvs[0])
    scope = store.scope("t", "completions", "k")
    assert await store.claim(scope, FP) is None
    with pytest.raises(ApiError) as err:
        await idem.IdempotencyStore(kvs[1]).claim(scope, OTHER_FP)
    assert err.value.status_code == 422


@pytest.mark.parametrize("status", [500, 503, 429, 409])
async def test_server_errors_and_rate_limits_release_the_key(kvs, status):
    store = idem.IdempotencyStore(kvs[0])
    scope = store.scope("t", "completions", f"k-{status}")

    async def fail() -> Response:
        raise ApiError(status, "try later")

    with pytest.raises(ApiError):
        await idem.run_once(store, scope, FP, fail)
    out = await idem.run_once(idem.IdempotencyStore(kvs[1]), scope, FP, lambda: _ok("second"))
    assert idem.REPLAYED_HEADER not in out.headers and out.content == {"id": "second"}


async def test_client_errors_are_stored_and_replayed(kvs):
    store = idem.IdempotencyStore(kvs[0])
    scope = store.scope("t", "completions", "k-400")

    async def bad() -> Response:
        raise ApiError(404, "The model 'x' does not exist", param="model", code="model_not_found")

    with pytest.raises(ApiError):
        await idem.run_once(store, scope, FP, bad)
    replay = await idem.run_once(store, scope, FP, lambda: _ok("never"))
    body = msgspec.json.decode(replay.content)
    assert replay.status_code == 404 and body["error"]["code"] == "model_not_found"


async def test_keys_are_scoped_per_tenant_and_route(kvs):
    store = idem.IdempotencyStore(kvs[0])
    first = await idem.run_once(store, store.scope("tenant-a", "completions", "same"), FP, lambda: _ok("a"))
    other_tenant = await idem.run_once(store, store.scope("tenant-b", "completions", "same"), OTHER_FP,
                                       lambda: _ok("b"))
    other_route = await idem.run_once(store, store.scope("tenant-a", "chat.completions", "same"), OTHER_FP,
                                      lambda: _ok("c"))
    assert [first.content, other_tenant.content, other_route.content] == [{"id": "a"}, {"id": "b"}, {"id": "c"}]
    assert all(idem.REPLAYED_HEADER not in r.headers for r in (first, other_tenant, other_route))


async def test_a_started_stream_cannot_be_replayed(kvs):
    store = idem.IdempotencyStore(kvs[0])
    scope = store.scope("t", "chat.completions", "k-stream")
    await idem.run_once(store, scope, FP, lambda: _ok("s"), streamed=True)
    with pytest.raises(ApiError) as err:
        await idem.run_once(store, scope, FP, lambda: _ok("again"))
    assert err.value.status_code == 409 and err.value.code == "idempotent_replay_unavailable"


async def test_a_dead_holder_frees_the_key_after_the_lease(kvs):
    store = idem.IdempotencyStore(kvs[0], lease_s=0.3)
    scope = store.scope("t", "completions", "k-lease")
    assert await store.claim(scope, FP) is None  # the holder never completes nor releases
    with pytest.raises(ApiError):
        await store.claim(scope, FP)
    await asyncio.sleep(0.4)
    assert await store.claim(scope, FP) is None


async def test_a_request_longer_than_the_lease_keeps_its_key(kvs):
    """The lease is renewed while the request runs, so it can be short (a dead holder frees the key soon)
    without a slow request losing its key to a retry."""
    store = idem.IdempotencyStore(kvs[0], lease_s=0.5)
    scope = store.scope("t", "completions", "k-slow")
    retry_answers: list = []

    async def slow() -> Response:
        await asyncio.sleep(0.8)  # past the lease: only its renewals keep the key
        try:
            await idem.IdempotencyStore(kvs[1], lease_s=0.5).claim(scope, FP)
            retry_answers.append("ran")
        except ApiError as exc:
            retry_answers.append(exc.code)
        await asyncio.sleep(0.8)
        return Response({"id": "slow"})

    await idem.run_once(store, scope, FP, slow)
    assert retry_answers == ["idempotency_key_in_use"]
    assert (await idem.run_once(store, scope, FP, lambda: _ok("never"))).content == b'{"id":"slow"}'


@pytest.mark.parametrize("outcome", [200, 404, 503])
async def test_redis_going_away_mid_request_keeps_the_answer_and_frees_the_key(redis_url, outcome):
    """Redis drops while the request runs, so neither its answer nor a release can be written: the client
    still gets the request's own outcome (not a Redis error), and once Redis is back a retry with the same key
    runs once the (short) lease lapsed instead of being refused with 409 for many minutes."""
    proxy = TcpProxy.to_redis(redis_url)
    prefix = f"loraplex-idem-outage-{time.time_ns()}:"
    flaky, steady = RedisKV(proxy.redis_url, prefix=prefix), RedisKV(redis_url, prefix=prefix)
    store = idem.IdempotencyStore(flaky, lease_s=0.5)
    scope = store.scope("t", "completions", f"k-outage-{outcome}")

    async def run() -> Response:
        proxy.cut()
        if outcome != 200:
            raise ApiError(outcome, "the request's own error")
        return Response({"id": "first"})

    try:
        if outcome == 200:
            assert (await idem.run_once(store, scope, FP, run)).content == {"id": "first"}
        else:
            with pytest.raises(ApiError) as err:
                await idem.run_once(store, scope, FP, run)
            assert err.value.status_code == outcome
        proxy.restore()
        await asyncio.sleep(0.7)
        retry = await idem.run_once(idem.IdempotencyStore(steady), scope, FP, lambda: _ok("second"))
        assert retry.content == {"id": "second"} and idem.REPLAYED_HEADER not in retry.headers
        assert idem.LEASE_S <= 60  # what a retry may wait when Redis came back too late for the release
    finally:
        proxy.close()
        await flaky.close()
        await steady.close()


async def _ok(response_id: str) -> Response:
    return Response({"id": response_id})
