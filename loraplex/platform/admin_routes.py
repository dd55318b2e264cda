"""Operator routes under ``/admin`` (keys with the ``admin`` scope): tenants and API keys."""

from __future__ import annotations

from datetime import datetime, timedelta

import msgspec
from litestar import Request, Router, delete, get, post, put
from litestar.params import Parameter

from loraplex.platform import tenants as svc
from loraplex.platform.auth import principal_of, require_scope
from loraplex.platform.db import as_utc, utcnow
from loraplex.platform.errors import bad_request, error_responses
from loraplex.platform.models import SCOPE_ADMIN, TENANT_ACTIVE, TENANT_SUSPENDED, ApiKey, Tenant

# ---- wire types -----------------------------------------------------------------------------------


class TenantCreate(msgspec.Struct):
    name: str
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None


class TenantLimits(msgspec.Struct):
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None


class TenantOut(msgspec.Struct):
    id: str
    name: str
    status: str
    created_at: datetime
    requests_per_minute: int | None
    tokens_per_minute: int | None
    object: str = "tenant"


class TenantList(msgspec.Struct):
    data: list[TenantOut]
    object: str = "list"


class KeyCreate(msgspec.Struct):
    tenant: str  # name or id
    scopes: list[str] | None = None  # default ["inference"]
    name: str | None = None
    expires_at: datetime | None = None
    expires_in_s: int | None = None


class KeyOut(msgspec.Struct):
    id: str
    tenant: str
    tenant_id: str
    scopes: list[str]
    name: str | None
    created_at: datetime
    expires_at: datetime | None
    revoked_at: datetime | None
    last_used_at: datetime | None
    object: str = "api_key"


class KeyCreated(msgspec.Struct):
    id: str
    key: str  # the secret key: shown once, never again
    tenant: str
    tenant_id: str
    scopes: list[str]
    name: str | None
    created_at: datetime
    expires_at: datetime | None
    object: str = "api_key"


class KeyList(msgspec.Struct):
    data: list[KeyOut]
    object: str = "list"


def tenant_out(t: Tenant) -> TenantOut:
    return TenantOut(
        id=t.id, name=t.name, status=t.status, created_at=as_utc(t.created_at),
        requests_per_minute=t.requests_per_minute, tokens_per_minute=t.tokens_per_minute,
    )


def key_out(k: ApiKey, t: Tenant) -> KeyOut:
    return KeyOut(
        id=k.id, tenant=t.name, tenant_id=t.id, scopes=list(k.scopes or []), name=k.name,
        created_at=as_utc(k.created_at), expires_at=as_utc(k.expires_at), revoked_at=as_utc(k.revoked_at),
        last_used_at=as_utc(k.last_used_at),
    )


# ---- handlers ------------------------------------------------------------------------------------

_ERR = error_responses(400, 401, 403, 404, 409)
_NAME = Parameter(description="tenant name or id", max_length=64)


@post("/tenants", status_code=201, responses=_ERR, summary="Create a tenant")
async def create_tenant(request: Request, data: TenantCreate) -> TenantOut:
    async with request.app.state.services.sessions() as s:
        return tenant_out(await svc.create_tenant(s, data.name, data.requests_per_minute, data.tokens_per_minute))


@get("/tenants", responses=_ERR, summary="List tenants")
async def list_tenants(request: Request) -> TenantList:
    async with request.app.state.services.sessions() as s:
        return TenantList(data=[tenant_out(t) for t in await svc.list_tenants(s)])


@get("/tenants/{tenant:str}", responses=_ERR, summary="Get a tenant")
async def get_tenant(request: Request, tenant: str = _NAME) -> TenantOut:
    async with request.app.state.services.sessions() as s:
        return tenant_out(await svc.get_tenant(s, tenant))


async def _set_status(request: Request, tenant: str, status: str) -> TenantOut:
    services = request.app.state.services
    async with services.sessions() as s:
        return tenant_out(await svc.set_tenant_status(s, services.kv, tenant, status))


@post("/tenants/{tenant:str}/suspend", status_code=200, responses=_ERR, summary="Suspend a tenant")
async def suspend_tenant(request: Request, tenant: str = _NAME) -> TenantOut:
    """Every key of the tenant stops working within a second, on every replica."""
    return await _set_status(request, tenant, TENANT_SUSPENDED)


@post("/tenants/{tenant:str}/activate", status_code=200, responses=_ERR, summary="Re-activate a tenant")
async def activate_tenant(request: Request, tenant: str = _NAME) -> TenantOut:
    return await _set_status(request, tenant, TENANT_ACTIVE)


@put("/tenants/{tenant:str}/limits", responses=_ERR, summary="Set a tenant's rate limits (null = default)")
async def set_limits(request: Request, data: TenantLimits, tenant: str = _NAME) -> TenantOut:
    services = request.app.state.services
    async with services.sessions() as s:
        return tenant_out(await svc.update_tenant_limits(
            s, services.kv, tenant, data.requests_per_minute, data.tokens_per_minute
        ))


@post("/keys", status_code=201, responses=_ERR, summary="Create an API key (the key is shown once)")
async def create_key(request: Request, data: KeyCreate) -> KeyCreated:
    expires_at = data.expires_at
    if data.expires_in_s is not None:
        if expires_at is not None:
            raise bad_request("Send expires_at or expires_in_s, not both.", param="expires_in_s")
        max_s = svc.MAX_KEY_DAYS * 86400
        if not 1 <= data.expires_in_s <= max_s:
            raise bad_request(f"expires_in_s must be between 1 and {max_s} ({svc.MAX_KEY_DAYS} days), got "
                              f"{data.expires_in_s}.", param="expires_in_s")
        expires_at = utcnow() + timedelta(seconds=data.expires_in_s)
    async with request.app.state.services.sessions() as s:
        key, new = await svc.create_key(s, data.tenant, data.scopes, data.name, expires_at)
        tenant = await svc.get_tenant(s, key.tenant_id)
    return KeyCreated(
        id=key.id, key=new.key, tenant=tenant.name, tenant_id=tenant.id, scopes=list(key.scopes), name=key.name,
        created_at=as_utc(key.created_at), expires_at=as_utc(key.expires_at),
    )


@get("/keys", responses=_ERR, summary="List API keys (never the secrets)")
async def list_keys(
    request: Request, tenant: str | None = Parameter(query="tenant", default=None, max_length=64)
) -> KeyList:
    async with request.app.state.services.sessions() as s:
        return KeyList(data=[key_out(k, t) for k, t in await svc.list_keys(s, tenant)])


@delete("/keys/{key_id:str}", status_code=200, responses=_ERR, summary="Revoke an API key")
async def revoke_key(request: Request, key_id: str = Parameter(max_length=32)) -> KeyOut:
    """Revocation reaches every replica within a second (pub/sub invalidation of the auth cache). The key making
    the request cannot revoke itself (409 ``own_key``): use another admin key or the CLI."""
    services = request.app.state.services
    caller = await principal_of(request)
    async with services.sessions() as s:
        key = await svc.revoke_key(s, services.kv, key_id, caller_key_id=caller.key_id)
        tenant = await svc.get_tenant(s, key.tenant_id)
        return key_out(key, tenant)


def route_handlers() -> list:
    return [
        Router(
            path="/admin",
            guards=[require_scope(SCOPE_ADMIN)],
            tags=["admin"],
            security=[{"bearer": []}],
            route_handlers=[
                create_tenant, list_tenants, get_tenant, suspend_tenant, activate_tenant, set_limits,
                create_key, list_keys, revoke_key,
            ],
        )
    ]
