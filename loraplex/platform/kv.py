"""One interface for cache, rate limits and pub/sub: Redis in production, in-process when embedded.

- ``get/set/delete``: strings with an optional TTL.
- ``token_bucket``: atomic take-from-bucket (a Lua script in Redis, so every replica sees one bucket).
- ``publish/subscribe``: fire-and-forget messages to every replica (key revocation, adapter changes).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger(__name__)

Handler = Callable[[str], Awaitable[None] | None]


@dataclass(frozen=True)
class BucketResult:
    allowed: bool
    remaining: float  # tokens left after this take (may be negative after a forced take)
    capacity: float
    retry_after_s: float  # 0 when allowed; else seconds until ``cost`` tokens are available
    reset_s: float  # seconds until the bucket is full again


class Subscription(Protocol):
    async def close(self) -> None: ...


class KV(Protocol):
    async def get(self, key: str) -> str | None: ...

    async def set(self, key: str, value: str, ttl_s: float | None = None) -> None: ...

    async def set_if_absent(self, key: str, value: str, ttl_s: float) -> bool:
        """Atomically set ``key`` unless it holds a live value; True when this call set it."""
        ...

    async def delete(self, key: str) -> None: ...

    async def token_bucket(
        self, key: str, capacity: float, refill_per_s: float, cost: float = 1.0, force: bool = False
    ) -> BucketResult:
        """Refill by elapsed time, then take ``cost`` if available (always when ``force``).

        A negative ``cost`` with ``force`` refunds (never above ``capacity``)."""
        ...

    async def publish(self, channel: str, message: str) -> None: ...

    async def subscribe(self, channel: str, handler: Handler) -> Subscription: ...

    async def ping(self) -> bool: ...

    async def close(self) -> None: ...


def _result(allowed: bool, tokens: float, capacity: float, rate: float, cost: float) -> BucketResult:
    retry = 0.0 if allowed else max(0.0, (cost - tokens) / rate)
    reset = max(0.0, (capacity - tokens) / rate)
    return BucketResult(allowed, tokens, capacity, retry, reset)


async def _call(handler: Handler, message: str) -> None:
    try:
        out = handler(message)
        if asyncio.iscoroutine(out):
            await out
    except Exception:  # a bad handler must not kill the subscription
        log.exception("pub/sub handler failed")


# ---- in-process ---------------------------------------------------------------------------------


class _LocalSubscription:
    def __init__(self, owner: LocalKV, channel: str, handler: Handler):
        self._owner, self._channel, self.handler = owner, channel, handler

    async def close(self) -> None:
        self._owner._subs.get(self._channel, set()).discard(self)


class LocalKV:
    """Single-process implementation (the embedded default). Not shared across processes."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._data: dict[str, tuple[str, float | None]] = {}
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, last refill time)
        self._subs: dict[str, set[_LocalSubscription]] = {}
        self._lock = asyncio.Lock()

    async def get(self, key: str) -> str | None:
        item = self._data.get(key)
        if item is None:
            return None
        value, expires = item
        if expires is not None and self._clock() >= expires:
            self._data.pop(key, None)
            return None
        return value

    async def set(self, key: str, value: str, ttl_s: float | None = None) -> None:
        self._data[key] = (value, None if ttl_s is None else self._clock() + ttl_s)
        if len(self._data) > 100_000:
            self._evict_expired()

    async def set_if_absent(self, key: str, value: str, ttl_s: float) -> bool:
        # get() and set() never suspend, so nothing else runs between the check and the write
        if await self.get(key) is not None:
            return False
        await self.set(key, value, ttl_s)
        return True

    def _evict_expired(self) -> None:
        now = self._clock()
        for k in [k for k, (_, exp) in self._data.items() if exp is not None and exp <= now]:
            self._data.pop(k, None)

    async def delete(self, key: str) -> None:
        self._data.pop(key, None)

    async def token_bucket(
        self, key: str, capacity: float, refill_per_s: float, cost: float = 1.0, force: bool = False
    ) -> BucketResult:
        # no await inside: atomic with respect to the event loop
        now = self._clock()
        tokens, last = self._buckets.get(key, (capacity, now))
        tokens = min(capacity, tokens + max(0.0, now - last) * refill_per_s)
        allowed = force or tokens >= cost
        if allowed:
            tokens = min(capacity, tokens - cost)  # a negative cost refunds
        self._buckets[key] = (tokens, now)
        return _result(allowed, tokens, capacity, refill_per_s, cost)

    async def publish(self, channel: str, message: str) -> None:
        for sub in list(self._subs.get(channel, ())):
            await _call(sub.handler, message)

    async def subscribe(self, channel: str, handler: Handler) -> Subscription:
        sub = _LocalSubscription(self, channel, handler)
        self._subs.setdefault(channel, set()).add(sub)
        return sub

    async def ping(self) -> bool:
        return True

    async def close(self) -> None:
        self._subs.clear()


# ---- Redis --------------------------------------------------------------------------------------

_BUCKET_LUA = """
local capacity = tonumber(ARGV[1])
local rate = tonumber(ARGV[2])
local cost = tonumber(ARGV[3])
local force = tonumber(ARGV[4])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local data = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = tonumber(data[1])
local ts = tonumber(data[2])
if tokens == nil or ts == nil then
  tokens = capacity
  ts = now
end
tokens = math.min(capacity, tokens + math.max(0, now - ts) * rate)
local allowed = 0
if force == 1 or tokens >= cost then
  tokens = math.min(capacity, tokens - cost)
  allowed = 1
end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'ts', tostring(now))
redis.call('EXPIRE', KEYS[1], math.ceil(capacity / rate) + 60)
return {allowed, tostring(tokens)}
"""


class _RedisSubscription:
    def __init__(self, pubsub, task: asyncio.Task):
        self._pubsub, self._task = pubsub, task

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._task
        with contextlib.suppress(Exception):
            await self._pubsub.aclose()


MAX_REDIS_CONNECTIONS = 512
# a subscription whose reads fail waits this long before the next, doubling up to the cap: at most one connection
# attempt per 2 s per subscription during an outage, and back within 2 s of Redis (messages sent before are missed)
RESUBSCRIBE_FIRST_WAIT_S = 0.5
RESUBSCRIBE_MAX_WAIT_S = 2.0


class _Outage:
    """One subscription's view of Redis: a warning when its reads start failing, an info line when one succeeds
    again, nothing in between (each subscription used to log a traceback every 0.5 s of an outage), and the
    wait before each retry."""

    def __init__(self, channel: str):
        self.channel = channel
        self.since: float | None = None  # monotonic time of the first failed read
        self.wait_s = RESUBSCRIBE_FIRST_WAIT_S

    def failed(self, exc: Exception) -> float:
        """Seconds to wait before the next read."""
        from redis.exceptions import ConnectionError as RedisConnectionError
        from redis.exceptions import TimeoutError as RedisTimeoutError

        if self.since is None:
            self.since = time.monotonic()
            # an unreachable Redis explains itself; anything else is a fault worth its traceback
            expected = isinstance(exc, (RedisConnectionError, RedisTimeoutError, OSError))
            log.warning("redis pub/sub %s: read failed (%s); retrying with backoff up to %g s, messages published "
                        "meanwhile are missed", self.channel, str(exc) or type(exc).__name__, RESUBSCRIBE_MAX_WAIT_S,
                        exc_info=None if expected else exc)
        wait_s = self.wait_s
        self.wait_s = min(self.wait_s * 2, RESUBSCRIBE_MAX_WAIT_S)
        return wait_s

    def answered(self) -> None:
        if self.since is not None:
            log.info("redis pub/sub %s: recovered after %.1f s", self.channel, time.monotonic() - self.since)
            self.since, self.wait_s = None, RESUBSCRIBE_FIRST_WAIT_S


class RedisKV:
    """Redis implementation; every replica shares keys, buckets and channels. Keys get ``prefix``."""

    def __init__(self, url: str, prefix: str = "loraplex:"):
        import redis.asyncio as redis

        # a blocking pool: a burst of requests waits briefly for a connection instead of failing with
        # "Too many connections" (a 500) once the default pool of 100 is in use
        pool = redis.BlockingConnectionPool.from_url(url, max_connections=MAX_REDIS_CONNECTIONS, timeout=30,
                                                     decode_responses=True, health_check_interval=10)
        self._redis = redis.Redis(connection_pool=pool)
        self._prefix = prefix
        self._bucket = self._redis.register_script(_BUCKET_LUA)
        self._subs: list[_RedisSubscription] = []

    def _k(self, key: str) -> str:
        return self._prefix + key

    async def get(self, key: str) -> str | None:
        return await self._redis.get(self._k(key))

    async def set(self, key: str, value: str, ttl_s: float | None = None) -> None:
        if ttl_s is None:
            await self._redis.set(self._k(key), value)
        else:
            await self._redis.set(self._k(key), value, px=max(1, int(ttl_s * 1000)))

    async def set_if_absent(self, key: str, value: str, ttl_s: float) -> bool:
        return bool(await self._redis.set(self._k(key), value, px=max(1, int(ttl_s * 1000)), nx=True))

    async def delete(self, key: str) -> None:
        await self._redis.delete(self._k(key))

    async def token_bucket(
        self, key: str, capacity: float, refill_per_s: float, cost: float = 1.0, force: bool = False
    ) -> BucketResult:
        allowed, tokens = await self._bucket(
            keys=[self._k("bucket:" + key)], args=[capacity, refill_per_s, cost, 1 if force else 0]
        )
        return _result(bool(int(allowed)), float(tokens), capacity, refill_per_s, cost)

    async def publish(self, channel: str, message: str) -> None:
        await self._redis.publish(self._k(channel), message)

    async def subscribe(self, channel: str, handler: Handler) -> Subscription:
        pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
        await pubsub.subscribe(self._k(channel))

        async def pump() -> None:
            outage = _Outage(channel)
            while True:
                try:
                    msg = await pubsub.get_message(timeout=1.0)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    # redis-py reconnects and resubscribes on the next read; until then, wait longer each time
                    await asyncio.sleep(outage.failed(exc))
                    continue
                outage.answered()
                if msg and msg.get("type") == "message":
                    await _call(handler, msg["data"])

        sub = _RedisSubscription(pubsub, asyncio.create_task(pump(), name=f"kv-sub:{channel}"))
        self._subs.append(sub)
        return sub

    async def ping(self) -> bool:
        try:
            return bool(await self._redis.ping())
        except Exception:
            return False

    async def close(self) -> None:
        for sub in self._subs:
            await sub.close()
        self._subs.clear()
        await self._redis.aclose()


def make_kv(redis_url: str | None, prefix: str = "loraplex:") -> KV:
    return RedisKV(redis_url, prefix=prefix) if redis_url else LocalKV()


def ceil_s(seconds: float) -> int:
    """Whole seconds for a ``Retry-After`` header (at least 1)."""
    return max(1, math.ceil(seconds))
