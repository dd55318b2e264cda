"""A Redis outage under a pub/sub subscription (auth invalidations, adapter changes): one warning when it starts,
without a traceback, one info line when the subscription is back, and messages flow again. Every subscription used
to log a warning with a full traceback every 0.5 s for as long as Redis was away (900 lines in 8 s)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from loraplex.platform.kv import RedisKV
from tests.integration.tcp_proxy import TcpProxy

CHANNELS = ("auth:invalidate", "adapters:changed")


async def deliver(publisher: RedisKV, received: dict[str, list[str]], message: str, within_s: float) -> None:
    """Publish ``message`` on every channel until each subscription has it (a subscription that is reconnecting
    misses what was published meanwhile: pub/sub is fire-and-forget)."""
    deadline = time.monotonic() + within_s
    while not all(message in received[c] for c in CHANNELS):
        assert time.monotonic() < deadline, f"{message!r} not delivered within {within_s} s: {received}"
        for channel in CHANNELS:
            await publisher.publish(channel, message)
        await asyncio.sleep(0.2)


async def test_an_outage_logs_one_warning_and_one_recovery_per_subscription(redis_url, caplog):
    caplog.set_level(logging.DEBUG, logger="loraplex.platform.kv")
    proxy = TcpProxy.to_redis(redis_url)
    prefix = f"test-{uuid.uuid4().hex[:12]}:"  # channels of this test only, on the shared Redis
    subscriber, publisher = RedisKV(proxy.redis_url, prefix=prefix), RedisKV(redis_url, prefix=prefix)
    received: dict[str, list[str]] = {c: [] for c in CHANNELS}
    try:
        for channel in CHANNELS:
            await subscriber.subscribe(channel, received[channel].append)
        await deliver(publisher, received, "before", within_s=5)
        caplog.clear()

        proxy.cut()  # every connection dropped, new ones closed at once
        await asyncio.sleep(5)
        during = [r for r in caplog.records if r.name == "loraplex.platform.kv"]
        proxy.restore()
        await deliver(publisher, received, "after", within_s=10)  # the backoff's cap, a read, a reconnect
    finally:
        await subscriber.close()
        await publisher.close()
        proxy.close()

    assert [r.levelno for r in during] == [logging.WARNING] * len(CHANNELS), [r.getMessage() for r in during]
    assert all(r.exc_info is None for r in during), "a connection error needs no traceback"
    assert all("retrying" in r.getMessage() for r in during)
    records = [r for r in caplog.records if r.name == "loraplex.platform.kv"]
    recovered = [r for r in records if r.levelno == logging.INFO and "recovered" in r.getMessage()]
    assert len(recovered) == len(CHANNELS), [r.getMessage() for r in records]
    assert len(records) == 2 * len(CHANNELS), [r.getMessage() for r in records]
    for channel in CHANNELS:
        assert any(channel in r.getMessage() for r in recovered)
