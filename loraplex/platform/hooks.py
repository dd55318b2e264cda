"""Extension points other areas implement: which models a tenant may use, and where usage goes.

- :class:`ModelResolver`: ``model`` string of a request -> base model or an adapter the tenant may use.
  The default knows the base model only; the adapter registry installs its own in its ``setup``.
- :class:`UsageSink`: called exactly once per request that reached the engine (finished, stopped,
  aborted by a disconnect, or failed). The default logs; the usage area installs the ledger.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Protocol

from loraplex.engine.lora_request import LoRARequest
from loraplex.platform.auth import Principal
from loraplex.platform.db import utcnow

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ResolvedModel:
    """What a ``model`` name means for one tenant. Never rendered with paths to clients."""

    name: str  # the id clients use (``/v1/models`` and the ``model`` field of responses)
    lora_request: LoRARequest | None = None  # None = the base model
    adapter_id: str | None = None  # registry id (for metering)
    adapter_version: int | None = None
    adapter_name: str | None = None
    owned_by: str = "loraplex"
    created: int = 0  # unix seconds
    parent: str | None = None  # for adapters: the base model id


class ModelResolver(Protocol):
    async def resolve(self, principal: Principal, model_name: str) -> ResolvedModel | None:
        """None when the model does not exist *or* the tenant may not use it (same 404 either way)."""
        ...

    async def list_models(self, principal: Principal) -> list[ResolvedModel]: ...


class BaseModelResolver:
    """Knows the base model only (used until the registry installs its resolver)."""

    def __init__(self, base_model_id: str, created: int | None = None):
        # OpenAI's ``created`` is a unix time; the base model is "created" when this server starts serving it
        created = int(time.time()) if created is None else created
        self.base = ResolvedModel(name=base_model_id, owned_by="loraplex", created=created)

    async def resolve(self, principal: Principal, model_name: str) -> ResolvedModel | None:
        return self.base if model_name == self.base.name else None

    async def list_models(self, principal: Principal) -> list[ResolvedModel]:
        return [self.base]


STATUS_COMPLETED = "completed"  # finished by stop/length
STATUS_ABORTED = "aborted"  # client went away; completion_tokens = tokens actually sent
STATUS_ERROR = "error"  # the engine failed mid-request


@dataclass(frozen=True)
class UsageEvent:
    request_id: str
    tenant_id: str
    tenant_name: str
    key_id: str
    model: str
    endpoint: str  # "completions" | "chat.completions"
    prompt_tokens: int  # that the engine ran: all of them unless aborted or failed first
    cached_prompt_tokens: int
    completion_tokens: int  # tokens actually delivered to the client
    status: str  # STATUS_*
    adapter_id: str | None = None
    adapter_version: int | None = None
    adapter_name: str | None = None
    queue_s: float | None = None  # arrival -> first scheduled
    ttft_s: float | None = None  # arrival -> first token
    total_s: float = 0.0  # arrival -> end
    finish_reason: str | None = None
    created_at: datetime = field(default_factory=utcnow)

    def as_dict(self) -> dict:
        out = asdict(self)
        out["created_at"] = self.created_at.isoformat()
        return out


class UsageSink(Protocol):
    async def record(self, event: UsageEvent) -> None: ...


class QuotaGate(Protocol):
    """Checked at admission, before the engine: ``reserve`` raises an ``ApiError`` (429) when the tenant's
    quota cannot cover ``estimated_tokens`` (with ``at_least``: a request without ``max_tokens``, which may run
    on less, is granted what is left down to ``at_least``); it returns None (no quota) or a reservation whose
    ``tokens`` is what was granted. ``release`` is called once per reservation, after the request's usage event
    went to the :class:`UsageSink` (or when it never reached the engine)."""

    async def reserve(self, principal: Principal, estimated_tokens: int,
                      at_least: int | None = None) -> object | None: ...

    def release(self, reservation: object | None) -> None: ...


class NoQuota:
    """No quotas (used until the usage area installs its own)."""

    async def reserve(self, principal: Principal, estimated_tokens: int,
                      at_least: int | None = None) -> object | None:
        return None

    def release(self, reservation: object | None) -> None:
        pass


class LoggingUsageSink:
    """Logs counts and ids (never prompt text)."""

    async def record(self, event: UsageEvent) -> None:
        log.info(
            "usage request=%s tenant=%s key=%s model=%s adapter=%s prompt=%d cached=%d completion=%d status=%s",
            event.request_id, event.tenant_name, event.key_id, event.model, event.adapter_id,
            event.prompt_tokens, event.cached_prompt_tokens, event.completion_tokens, event.status,
        )
