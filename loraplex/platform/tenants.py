"""Tenant and API-key operations shared by the admin routes and the ``loraplex admin`` CLI."""

from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from loraplex.platform.auth import KEY_ID_RE, NewKey, generate_key, publish_invalidation
from loraplex.platform.db import as_utc, utcnow
from loraplex.platform.errors import ApiError, bad_request, not_found
from loraplex.platform.kv import KV
from loraplex.platform.migrate import begin_startup_lock
from loraplex.platform.models import (
    ALL_SCOPES,
    SCOPE_ADMIN,
    SCOPE_INFERENCE,
    TENANT_ACTIVE,
    TENANT_STATUSES,
    TENANT_SUSPENDED,
    ApiKey,
    Tenant,
)

TENANT_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}\Z")
TENANT_NAME_RULE = ("must be 1-63 characters of lowercase letters, digits, '-' or '_', starting with a letter or "
                    "digit")
TENANT_ID_RE = re.compile(r"^[0-9a-f]{32}\Z")
ADMIN_TENANT = "admin"
MAX_KEY_DAYS = 36500  # how far ahead a key may expire (100 years: far enough for "never", near enough for a date type)


def validate_tenant_name(name: str) -> str:
    if not TENANT_NAME_RE.match(name or ""):
        raise bad_request(f"Tenant name {TENANT_NAME_RULE}.", param="name")
    return name


def validate_scopes(scopes: list[str] | None) -> list[str]:
    """None (not given) is the default scope; an explicit empty list is an error (a key with no scope can
    call nothing)."""
    if scopes is None:
        return [SCOPE_INFERENCE]
    if not scopes:
        raise bad_request(f"scopes must name at least one scope (allowed: {list(ALL_SCOPES)}); leave the field out "
                          f"for the default [{SCOPE_INFERENCE!r}]", param="scopes")
    scopes = list(dict.fromkeys(scopes))
    bad = [s for s in scopes if s not in ALL_SCOPES]
    if bad:
        raise bad_request(f"Unknown scope(s) {bad}; allowed: {list(ALL_SCOPES)}", param="scopes")
    return scopes


# the limit columns are 32-bit integers on PostgreSQL; SQLite would take more, so the check is here for both
MAX_RATE_LIMIT = 2**31 - 1


def _positive_or_none(value: int | None, param: str) -> int | None:
    if value is not None and not 1 <= value <= MAX_RATE_LIMIT:
        raise bad_request(f"{param} must be between 1 and {MAX_RATE_LIMIT} (or null for the server default), "
                          f"got {value}", param=param)
    return value


async def create_tenant(
    session: AsyncSession, name: str, requests_per_minute: int | None = None, tokens_per_minute: int | None = None
) -> Tenant:
    tenant = Tenant(
        name=validate_tenant_name(name),
        status=TENANT_ACTIVE,
        requests_per_minute=_positive_or_none(requests_per_minute, "requests_per_minute"),
        tokens_per_minute=_positive_or_none(tokens_per_minute, "tokens_per_minute"),
        created_at=utcnow(),
    )
    session.add(tenant)
    try:
        await session.commit()
    except IntegrityError as exc:
        await session.rollback()
        raise ApiError(409, f"A tenant named '{name}' already exists.", param="name", code="conflict") from exc
    return tenant


async def list_tenants(session: AsyncSession) -> list[Tenant]:
    return list((await session.execute(select(Tenant).order_by(Tenant.created_at, Tenant.name))).scalars())


async def get_tenant(session: AsyncSession, name_or_id: str) -> Tenant:
    if not (TENANT_NAME_RE.match(name_or_id or "") or TENANT_ID_RE.match(name_or_id or "")):
        raise not_found(f"No tenant '{name_or_id[:64]}'.", param="tenant")
    row = (
        await session.execute(select(Tenant).where((Tenant.name == name_or_id) | (Tenant.id == name_or_id)))
    ).scalars().first()
    if row is None:
        raise not_found(f"No tenant '{name_or_id}'.", param="tenant")
    return row


async def set_tenant_status(session: AsyncSession, kv: KV, name_or_id: str, status: str) -> Tenant:
    assert status in TENANT_STATUSES
    tenant = await get_tenant(session, name_or_id)
    if tenant.name == ADMIN_TENANT and status == TENANT_SUSPENDED:
        raise bad_request("The admin tenant cannot be suspended.", param="tenant")
    await publish_invalidation(kv, tenant_id=tenant.id)  # before the change too: see revoke_key
    tenant.status = status
    await session.commit()
    await publish_invalidation(kv, tenant_id=tenant.id)
    return tenant


async def update_tenant_limits(
    session: AsyncSession, kv: KV, name_or_id: str, requests_per_minute: int | None, tokens_per_minute: int | None
) -> Tenant:
    tenant = await get_tenant(session, name_or_id)
    rpm = _positive_or_none(requests_per_minute, "requests_per_minute")
    tpm = _positive_or_none(tokens_per_minute, "tokens_per_minute")
    await publish_invalidation(kv, tenant_id=tenant.id)  # before the change too: see revoke_key
    tenant.requests_per_minute, tenant.tokens_per_minute = rpm, tpm
    await session.commit()
    await publish_invalidation(kv, tenant_id=tenant.id)
    return tenant


def _key_expiry(expires_at: datetime | None) -> datetime | None:
    """``expires_at`` in UTC (naive means UTC), in the future and at most ``MAX_KEY_DAYS`` ahead. SQLite keeps no
    offset: a time stored as ``+14:00`` would be read back as that wall-clock time in UTC, 14 hours late."""
    if expires_at is None:
        return None
    expires_at = as_utc(expires_at)  # naive: UTC
    ahead = expires_at - utcnow()  # before converting: a time near year 9999 may not fit in UTC
    if ahead <= timedelta(0):
        raise bad_request("expires_at must be in the future.", param="expires_at")
    if ahead > timedelta(days=MAX_KEY_DAYS):
        raise bad_request(f"expires_at must be at most {MAX_KEY_DAYS} days ahead.", param="expires_at")
    return expires_at.astimezone(timezone.utc)


async def create_key(
    session: AsyncSession,
    tenant_name_or_id: str,
    scopes: list[str] | None = None,
    name: str | None = None,
    expires_at: datetime | None = None,
) -> tuple[ApiKey, NewKey]:
    tenant = await get_tenant(session, tenant_name_or_id)
    scopes = validate_scopes(scopes)
    if SCOPE_ADMIN in scopes and tenant.name != ADMIN_TENANT:
        # an admin key acts on every tenant; keeping them in one tenant keeps that visible
        raise bad_request(f"The '{SCOPE_ADMIN}' scope is only granted to keys of the '{ADMIN_TENANT}' tenant.",
                          param="scopes")
    expires_at = _key_expiry(expires_at)
    if name is not None and (len(name) > 128 or not name.isprintable()):
        raise bad_request("name must be at most 128 printable characters.", param="name")
    key, new = _add_key(session, tenant, scopes, name, expires_at)
    await session.commit()
    return key, new


def _add_key(session: AsyncSession, tenant: Tenant, scopes: list[str], name: str | None,
             expires_at: datetime | None) -> tuple[ApiKey, NewKey]:
    """A new key in the session's transaction (checked by the caller, not yet committed)."""
    new = generate_key()
    key = ApiKey(
        id=new.key_id, tenant_id=tenant.id, key_hash=new.key_hash, scopes=scopes, name=name,
        created_at=utcnow(), expires_at=expires_at,
    )
    session.add(key)
    return key, new


async def list_keys(session: AsyncSession, tenant_name_or_id: str | None = None) -> list[tuple[ApiKey, Tenant]]:
    stmt = select(ApiKey, Tenant).join(Tenant).order_by(ApiKey.created_at)
    if tenant_name_or_id:
        tenant = await get_tenant(session, tenant_name_or_id)
        stmt = stmt.where(ApiKey.tenant_id == tenant.id)
    return [(k, t) for k, t in (await session.execute(stmt)).all()]


async def get_key(session: AsyncSession, key_id: str, tenant_id: str | None = None) -> ApiKey:
    if not KEY_ID_RE.match(key_id or ""):
        raise not_found(f"No API key '{key_id[:32]}'.", param="key_id")
    stmt = select(ApiKey).where(ApiKey.id == key_id)
    if tenant_id is not None:
        stmt = stmt.where(ApiKey.tenant_id == tenant_id)
    key = (await session.execute(stmt)).scalars().first()
    if key is None:
        raise not_found(f"No API key '{key_id}'.", param="key_id")
    return key


async def revoke_key(session: AsyncSession, kv: KV, key_id: str, tenant_id: str | None = None, *,
                     caller_key_id: str | None = None) -> ApiKey:
    """``caller_key_id``: the key making an HTTP request, which may not revoke itself (an operator revoking
    the admin key in use would lock themselves out; the CLI, which needs no key, passes None)."""
    if caller_key_id is not None and key_id == caller_key_id:
        raise ApiError(409, f"Key {key_id} is the key making this request and cannot revoke itself: revoke it "
                       f"with another admin key, or with 'loraplex admin key revoke {key_id}' on the server.",
                       param="key_id", code="own_key")
    key = await get_key(session, key_id, tenant_id)
    if key.revoked_at is None:
        # publish before the change as well as after: with Redis unreachable this fails (503) while nothing
        # is changed yet, rather than after a commit whose invalidation then reached no replica
        await publish_invalidation(kv, key_id=key.id)
        key.revoked_at = utcnow()
        await session.commit()
    await publish_invalidation(kv, key_id=key.id)
    return key


async def bootstrap_admin(session: AsyncSession) -> str | None:
    """On first start: the ``admin`` tenant and one admin key. Returns the key (to print once) or None.

    Never again once any admin key was issued (recovery: ``loraplex admin key create --tenant admin
    --scope admin`` on the database). Replicas starting together on an empty database take turns: the check
    and the tenant and key it leads to are one transaction under the start-up lock, so a later holder sees the
    first one's key and prints nothing. ``session`` must not be in a transaction yet."""
    await begin_startup_lock(session)
    try:
        rows = (await session.execute(
            select(ApiKey.scopes).join(Tenant).where(Tenant.name == ADMIN_TENANT)
        )).all()
        if any(SCOPE_ADMIN in (scopes or []) for (scopes,) in rows):
            await session.commit()
            return None
        tenant = (await session.execute(select(Tenant).where(Tenant.name == ADMIN_TENANT))).scalars().first()
        if tenant is None:
            tenant = Tenant(name=ADMIN_TENANT, status=TENANT_ACTIVE, created_at=utcnow())
            session.add(tenant)
            await session.flush()
        _, new = _add_key(session, tenant, [SCOPE_ADMIN], "bootstrap", None)
        await session.commit()
    except BaseException:
        await session.rollback()
        raise
    return new.key
