"""Registry changes on the KV bus: a generation stamp for cached lookups, and engine eviction.

Every change (a version becomes ready, a delete, a visibility or sharing edit) writes a new generation
token; cached lookups are keyed by it, so every replica stops using stale entries at once without
scanning keys. Deletes also publish the versions' ``lora_int_id``s; each replica's listener tells its
local engine to drop them (the engine defers that until its running requests finish).
"""

from __future__ import annotations

import json
import logging

from loraplex.platform.db import new_id
from loraplex.platform.kv import KV, Subscription

log = logging.getLogger(__name__)

CHANNEL = "registry:events"
GENERATION_KEY = "registry:gen"


async def current_generation(kv: KV) -> str:
    gen = await kv.get(GENERATION_KEY)
    if gen is None:
        gen = new_id()
        await kv.set(GENERATION_KEY, gen)
    return gen


async def bump_generation(kv: KV) -> None:
    await kv.set(GENERATION_KEY, new_id())


async def before_change(kv: KV) -> None:
    """Call before committing any change a cached lookup could contradict: an upload (a name that missed, or
    an older version, would keep resolving), a delete, an edit of visibility or sharing.

    Renews the generation, so the change fails closed (the KV's error: a 503) while nothing is committed yet.
    Committed without a renewal, the cached lookups stay in the KV (it is unreachable, not emptied) and every
    replica keeps resolving the old state for up to the cache TTL once it answers again. The renewal after
    the commit (``_announce``) drops what was cached in between.
    """
    await bump_generation(kv)


async def _announce(kv: KV, kind: str, lora_int_ids: list[int], model: str) -> None:
    # the database change is already committed: a KV outage must not turn it into an error (every change
    # checked the KV just before, see before_change). Cached lookups then expire by their
    # TTL, and a replica's engine drops a deleted adapter at the latest when its host cache evicts it (a
    # deleted adapter no longer resolves, so no new request can use it).
    try:
        await bump_generation(kv)
        await kv.publish(CHANNEL, json.dumps({"type": kind, "lora_int_ids": lora_int_ids, "model": model}))
    except Exception:
        log.warning("could not announce registry change %s %s (KV unavailable)", kind, model, exc_info=True)


async def publish_ready(kv: KV, lora_int_id: int, model: str) -> None:
    await _announce(kv, "ready", [lora_int_id], model)


async def publish_deleted(kv: KV, lora_int_ids: list[int], model: str) -> None:
    await _announce(kv, "deleted", lora_int_ids, model)


async def publish_changed(kv: KV, model: str) -> None:
    await _announce(kv, "changed", [], model)


class EngineEvictor:
    """Subscribes to registry events and evicts deleted adapter versions from this replica's engine."""

    def __init__(self, services):
        self._services = services
        self._sub: Subscription | None = None
        self.num_evicted = 0

    async def start(self) -> None:
        self._sub = await self._services.kv.subscribe(CHANNEL, self._on_message)

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.close()

    async def _on_message(self, message: str) -> None:
        try:
            event = json.loads(message)
            kind, ids = event["type"], [int(i) for i in event["lora_int_ids"]]
        except (ValueError, KeyError, TypeError):
            log.warning("ignored a malformed registry event")
            return
        log.info("registry event %s: %s", kind, event.get("model"))
        engine = self._services.engine
        if kind != "deleted" or engine is None:
            return
        for lora_int_id in ids:
            try:
                await engine.remove_adapter(lora_int_id)
                self.num_evicted += 1
            except Exception:
                log.warning("engine could not evict adapter %d", lora_int_id, exc_info=True)
