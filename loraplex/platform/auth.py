"""API keys and request authentication.

Key format: ``lpx-<key_id>-<secret>``; ``key_id`` is public (12 lowercase alphanumerics), the secret
is 40 random alphanumerics. Only SHA-256 of the whole key is stored; the check is constant-time, and
an unknown key id costs the same hash + compare as a wrong secret. A malformed key is refused
before any database query.

Resolved keys are cached in-process for a short TTL. Revocation, expiry edits and tenant suspension
publish an invalidation on the KV bus (Redis pub/sub across replicas), so a revoked key stops working
within a second everywhere; the TTL bounds staleness if a message is lost.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import re
import secrets
import string
import time
from dataclasses import dataclass, field
from datetime import datetime

from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler
from sqlalchemy import select, update

from loraplex.platform.db import SessionFactory, as_utc, utcnow
from loraplex.platform.errors import forbidden, unauthorized
from loraplex.platform.kv import KV, Subscription
from loraplex.platform.models import SCOPE_ADMIN, TENANT_ACTIVE, ApiKey, Tenant
from loraplex.platform.single_flight import SingleFlight

log = logging.getLogger(__name__)

KEY_PREFIX = "lpx"
KEY_ID_LEN = 12
SECRET_LEN = 40
_KEY_RE = re.compile(rf"^{KEY_PREFIX}-([a-z0-9]{{{KEY_ID_LEN}}})-([A-Za-z0-9]{{{SECRET_LEN}}})\Z")
KEY_ID_RE = re.compile(rf"^[a-z0-9]{{{KEY_ID_LEN}}}\Z")
_ALNUM = string.ascii_letters + string.digits
_ID_ALPHABET = string.ascii_lowercase + string.digits
INVALIDATE_CHANNEL = "auth:invalidate"
_DUMMY_HASH = hashlib.sha256(b"lpx-not-a-key").hexdigest()
LAST_USED_WRITE_INTERVAL_S = 60.0
# the servers' auth cache TTL: with Redis, pub/sub invalidates at once and the TTL only bounds a lost message;
# embedded, the CLI (another process) cannot reach the in-process bus, so the TTL alone bounds it (< 1 s)
AUTH_CACHE_TTL_REDIS_S = 5.0
AUTH_CACHE_TTL_EMBEDDED_S = 0.5
MAX_CACHED_KEYS = 50_000


@dataclass(frozen=True)
class Principal:
    tenant_id: str
    tenant_name: str
    key_id: str
    scopes: frozenset[str]
    # per-tenant limit overrides (None = server default)
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None

    @property
    def is_admin(self) -> bool:
        return SCOPE_ADMIN in self.scopes

    def has_scope(self, scope: str) -> bool:
        # admin implies every scope
        return scope in self.scopes or self.is_admin


@dataclass(frozen=True)
class NewKey:
    key: str  # shown once
    key_id: str
    key_hash: str


def generate_key() -> NewKey:
    key_id = "".join(secrets.choice(_ID_ALPHABET) for _ in range(KEY_ID_LEN))
    secret = "".join(secrets.choice(_ALNUM) for _ in range(SECRET_LEN))
    key = f"{KEY_PREFIX}-{key_id}-{secret}"
    return NewKey(key=key, key_id=key_id, key_hash=hash_key(key))


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def parse_key(raw: str | None) -> str | None:
    """The key id of a well-formed key, else None (no I/O)."""
    if not raw or len(raw) > 80:
        return None
    m = _KEY_RE.match(raw)
    return m.group(1) if m else None


def authorization_bearer(header: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header value (None: no header, or another scheme)."""
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def bearer_token(connection: ASGIConnection) -> str | None:
    header = connection.headers.get("authorization")
    if header:
        return authorization_bearer(header)
    # some clients send the key as x-api-key
    return connection.headers.get("x-api-key")


@dataclass
class _Cached:
    key_hash: str
    principal: Principal | None  # None: unknown, revoked, or its tenant is suspended
    expires_at: datetime | None
    tenant_id: str | None = None
    fetched: float = field(default_factory=time.monotonic)


class Authenticator:
    """Key id -> principal, with a TTL cache invalidated over pub/sub."""

    def __init__(self, sessions: SessionFactory, kv: KV, cache_ttl_s: float = 5.0):
        self._sessions = sessions
        self._kv = kv
        self._ttl = cache_ttl_s
        self._cache: dict[str, _Cached] = {}
        self._invalidations = 0  # bumped by every invalidation message: a read that overlaps one is not cached
        self._reads: SingleFlight[_Cached] = SingleFlight()
        self._last_used_written: dict[str, float] = {}
        self._sub: Subscription | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        self._sub = await self._kv.subscribe(INVALIDATE_CHANNEL, self._on_invalidate)

    async def stop(self) -> None:
        if self._sub:
            await self._sub.close()
        if self._tasks:  # let last-used writes finish (cancelling one mid-query upsets the pool)
            await asyncio.wait(list(self._tasks), timeout=2.0)
        for task in list(self._tasks):
            task.cancel()

    def _on_invalidate(self, message: str) -> None:
        self._invalidations += 1
        kind, _, ident = message.partition(":")
        if kind == "key":
            self._cache.pop(ident, None)
        elif kind == "tenant":
            for kid in [k for k, c in self._cache.items() if c.tenant_id == ident]:
                self._cache.pop(kid, None)
        else:
            self._cache.clear()

    async def authenticate(self, raw_key: str | None) -> Principal:
        key_id = parse_key(raw_key)
        if key_id is None:
            raise unauthorized("Invalid API key: expected 'Authorization: Bearer lpx-...'")
        entry = self._cache.get(key_id)
        if entry is None or time.monotonic() - entry.fetched > self._ttl:
            # one read per key id for a burst of requests (a new one after an invalidation: see _load)
            entry = await self._reads.run((key_id, self._invalidations), lambda: self._load(key_id))
        # unknown, revoked and suspended ids are cached too and still hashed and compared, so a wrong
        # secret for a real key id costs the same as any other bad key (no key-id enumeration by timing)
        ok = hmac.compare_digest(hash_key(raw_key), entry.key_hash)
        if not ok or entry.principal is None:
            raise unauthorized("Invalid API key")
        if entry.expires_at is not None and entry.expires_at <= utcnow():
            raise unauthorized("API key has expired")
        self._touch(key_id)
        return entry.principal

    async def _load(self, key_id: str) -> _Cached:
        invalidations = self._invalidations
        async with self._sessions() as session:
            row = (
                await session.execute(select(ApiKey, Tenant).join(Tenant).where(ApiKey.id == key_id))
            ).first()
        if row is None or row[0].revoked_at is not None or row[1].status != TENANT_ACTIVE:
            entry = _Cached(key_hash=_DUMMY_HASH, principal=None, expires_at=None,
                            tenant_id=row[1].id if row is not None else None)
        else:
            key, tenant = row
            principal = Principal(
                tenant_id=tenant.id, tenant_name=tenant.name, key_id=key.id, scopes=frozenset(key.scopes or ()),
                requests_per_minute=tenant.requests_per_minute, tokens_per_minute=tenant.tokens_per_minute,
            )
            entry = _Cached(key_hash=key.key_hash, principal=principal, expires_at=as_utc(key.expires_at),
                            tenant_id=tenant.id)
        self._cache.pop(key_id, None)
        if self._invalidations != invalidations:
            # a revocation or suspension may have landed after the read: serve this request from it (it began
            # before), but do not keep it for the TTL
            return entry
        if len(self._cache) >= MAX_CACHED_KEYS:  # bounded even under a flood of random key ids
            self._cache.pop(next(iter(self._cache)))
        self._cache[key_id] = entry
        return entry

    def _touch(self, key_id: str) -> None:
        """Record last use, at most once a minute per key, off the request path."""
        now = time.monotonic()
        if now - self._last_used_written.get(key_id, -1e9) < LAST_USED_WRITE_INTERVAL_S:
            return
        self._last_used_written[key_id] = now
        task = asyncio.create_task(self._write_last_used(key_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _write_last_used(self, key_id: str) -> None:
        try:
            async with self._sessions() as session:
                await session.execute(update(ApiKey).where(ApiKey.id == key_id).values(last_used_at=utcnow()))
                await session.commit()
        except Exception:
            log.warning("could not record last use of key %s", key_id, exc_info=True)


async def publish_invalidation(kv: KV, *, key_id: str | None = None, tenant_id: str | None = None) -> None:
    """Tell every replica to drop cached auth for a key or a whole tenant."""
    if key_id:
        await kv.publish(INVALIDATE_CHANNEL, f"key:{key_id}")
    if tenant_id:
        await kv.publish(INVALIDATE_CHANNEL, f"tenant:{tenant_id}")


# ---- Litestar glue ------------------------------------------------------------------------------


async def principal_of(connection: ASGIConnection) -> Principal:
    """Authenticate once per request (cached on the connection state)."""
    cached = connection.state.get("principal")
    if cached is not None:
        return cached
    services = connection.app.state.services
    principal = await services.authenticator.authenticate(bearer_token(connection))
    connection.state.principal = principal
    return principal


def require_scope(*scopes: str):
    """A guard: the caller must hold a valid key with every scope listed (admin implies all)."""

    async def guard(connection: ASGIConnection, _: BaseRouteHandler) -> None:
        principal = await principal_of(connection)
        missing = [s for s in scopes if not principal.has_scope(s)]
        if missing:
            raise forbidden(f"This API key lacks the scope(s): {', '.join(missing)}")

    guard.__name__ = "require_" + "_".join(s.replace(":", "_") for s in scopes or ("key",))
    return guard


async def provide_principal(request: ASGIConnection) -> Principal:
    """Dependency ``principal: Principal`` for handlers (use with a ``require_scope`` guard)."""
    return await principal_of(request)
