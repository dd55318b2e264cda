"""The platform's ModelResolver backed by the registry, with lookups cached in the KV store.

Cache keys carry the registry generation (see events.py), so any change anywhere makes every replica's
next lookup go to the database; misses are cached too, so unknown names cannot hammer the database.
"""

from __future__ import annotations

import json
import logging

from loraplex.engine.lora_request import LoRARequest
from loraplex.platform.auth import Principal
from loraplex.platform.db import SessionFactory
from loraplex.platform.hooks import ModelResolver, ResolvedModel
from loraplex.platform.kv import KV
from loraplex.platform.registry import events, queries
from loraplex.platform.registry.names import parse_model_name
from loraplex.platform.registry.store import AdapterStore

log = logging.getLogger(__name__)

CACHE_TTL_S = 60.0
_MISS = "-"


class RegistryModelResolver:
    def __init__(self, sessions: SessionFactory, kv: KV, store: AdapterStore, base: ModelResolver,
                 base_model_id: str):
        self.sessions, self.kv, self.store = sessions, kv, store
        self.base = base
        self.base_model_id = base_model_id
        self.num_db_lookups = 0

    async def resolve(self, principal: Principal, model_name: str) -> ResolvedModel | None:
        base = await self.base.resolve(principal, model_name)
        if base is not None:
            return base
        ref = parse_model_name(model_name)
        if ref is None:
            return None
        found = await self._cached_lookup(principal, model_name, ref)
        return None if found is None else self._resolved(model_name, found)

    async def _cached_lookup(self, principal: Principal, model_name: str, ref) -> queries.Lookup | None:
        key = None
        try:
            gen = await events.current_generation(self.kv)
            key = f"registry:model:{gen}:{principal.tenant_id}:{model_name}"
            hit = await self.kv.get(key)
            if hit is not None:
                return None if hit == _MISS else queries.Lookup(**json.loads(hit))
        except Exception:  # the cache is an optimisation: without it, ask the database
            log.warning("registry cache unavailable; reading the database", exc_info=True)
        async with self.sessions() as session:
            found = await queries.lookup(session, principal, ref)
        self.num_db_lookups += 1
        if key is not None:
            try:
                await self.kv.set(key, _MISS if found is None else json.dumps(found.as_dict()), CACHE_TTL_S)
            except Exception:
                log.warning("could not cache a registry lookup", exc_info=True)
        return found

    def _resolved(self, model_name: str, found: queries.Lookup) -> ResolvedModel:
        label = f"{found.owner}/{found.name}"
        return ResolvedModel(
            name=model_name,
            lora_request=LoRARequest(lora_name=f"{label}@{found.version}", lora_int_id=found.version_id,
                                     lora_path=str(self.store.local_path(found.digest))),
            adapter_id=found.adapter_id, adapter_version=found.version, adapter_name=label,
            owned_by=found.owner, created=found.created, parent=self.base_model_id,
        )

    async def list_models(self, principal: Principal) -> list[ResolvedModel]:
        models = list(await self.base.list_models(principal))
        async with self.sessions() as session:
            listed = await queries.list_usable(session, principal)
        for item in listed:
            ready = item.latest_ready
            if ready is None or ready.digest is None:
                continue
            own = item.adapter.tenant_id == principal.tenant_id
            name = item.adapter.name if own else f"{item.owner}/{item.adapter.name}"
            models.append(self._resolved(name, queries.Lookup(
                adapter_id=item.adapter.id, owner=item.owner, name=item.adapter.name, version=ready.version,
                version_id=ready.id, digest=ready.digest, created=queries.timestamp(ready.ready_at))))
        return models
