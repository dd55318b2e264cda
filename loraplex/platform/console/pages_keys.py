"""API keys: list (never hashes), create (the secret is shown once), revoke.

Operators manage every tenant's keys. A tenant manages its own, and can only grant scopes its current
key holds (no escalation from an inference key to ``adapters:write``).
"""

from __future__ import annotations

import hashlib
import re
from datetime import timedelta

from litestar import Request, Response, get, post
from litestar.params import Parameter

from loraplex.platform import tenants as svc
from loraplex.platform.console.deps import form_of, session_of, whole_number
from loraplex.platform.console.render import page, redirect
from loraplex.platform.db import as_utc, utcnow
from loraplex.platform.errors import ApiError
from loraplex.platform.models import ALL_SCOPES, SCOPE_ADMIN

MAX_EXPIRY_DAYS = 3650
_BACK_RE = re.compile(r"/console/tenants/([a-z0-9][a-z0-9_-]{0,62})(?:[?#]|$)")


@get("/keys", include_in_schema=False)
async def keys_page(request: Request) -> Response:
    session = await session_of(request)
    p = session.principal
    async with request.app.state.services.sessions() as s:
        rows = await svc.list_keys(s, None if p.is_admin else p.tenant_id)
        tenants = await svc.list_tenants(s) if p.is_admin else []
    rows.sort(key=lambda kt: (kt[0].revoked_at is not None, -kt[0].created_at.timestamp()))
    scopes = list(ALL_SCOPES) if p.is_admin else [s for s in ALL_SCOPES if s in p.scopes]
    return page(request, "keys.html", session, active="keys", rows=rows, tenants=tenants, scopes=scopes,
                preset_tenant=request.query_params.get("tenant", ""))


@post("/keys", include_in_schema=False)
async def create_key(request: Request) -> Response:
    session = await session_of(request)
    p = session.principal
    form = await form_of(request, session)
    # a tenant's key is always for itself, whatever the form says
    tenant = (form.get("tenant") or "").strip() if p.is_admin else p.tenant_id
    if not tenant:
        raise ApiError(400, "Choose the tenant the key is for.", param="tenant")
    scopes = [s for s in ALL_SCOPES if form.get(f"scope_{s}")]
    if not scopes:
        raise ApiError(400, "Scopes: choose at least one scope.", param="scopes")
    if not p.is_admin and any(s not in p.scopes or s == SCOPE_ADMIN for s in scopes):
        raise ApiError(403, "You can only grant scopes your own key holds.", type="permission_error",
                       param="scopes", code="insufficient_scope")
    name = (form.get("name") or "").strip() or None
    expires_at = None
    days = whole_number(form, "expires_in_days", "Expires in (days)", maximum=MAX_EXPIRY_DAYS, unit="days",
                        blank="blank = no expiry")
    if days is not None:
        expires_at = utcnow() + timedelta(days=days)
    if not p.is_admin:
        expires_at = await _within_own_expiry(request, p, expires_at)
    if not await _first_submission(request, session, form.get("form_id") or ""):
        # a reload (or a double click) of the form that already made a key: a second live key, whose secret
        # replaced the first one's on the screen, is not what anyone meant
        raise ApiError(409, "This form was already submitted and its key created; its secret was shown once, "
                       "then. If you did not copy it, revoke that key below and create another.",
                       param="form_id", code="conflict")
    async with request.app.state.services.sessions() as s:
        key, new = await svc.create_key(s, tenant, scopes, name, expires_at)
        owner = await svc.get_tenant(s, key.tenant_id)
    # rendered, not redirected: the secret exists only in this response (no-store)
    return page(request, "key_created.html", session, active="keys", key=key, tenant=owner, secret=new.key,
                status_code=201)


async def _within_own_expiry(request: Request, p, expires_at):
    """A tenant's key never makes a key that outlives it: blank ("never") becomes its own expiry, a later one is
    refused (a key lent for a day must not leave one behind that never expires)."""
    async with request.app.state.services.sessions() as s:
        own = as_utc((await svc.get_key(s, p.key_id, p.tenant_id)).expires_at)
    if own is None or (expires_at is not None and expires_at <= own):
        return expires_at
    if expires_at is None:
        return own
    raise ApiError(400, f"Expires in (days): the key you signed in with expires {own:%Y-%m-%d %H:%M} UTC, and a "
                        "key it makes cannot outlive it; leave the field blank for that date, or choose fewer days.",
                   param="expires_in_days")


FORM_ID_TTL_S = 24 * 3600.0


async def _first_submission(request: Request, session, form_id: str) -> bool:
    """Whether this session has not sent this form before (forms without an id, e.g. scripted posts, always are)."""
    if not form_id:
        return True
    digest = hashlib.sha256(f"{session.sid}:{form_id[:64]}".encode()).hexdigest()
    return await request.app.state.services.kv.set_if_absent(f"console:form:{digest}", "1", FORM_ID_TTL_S)


@post("/keys/{key_id:str}/revoke", include_in_schema=False, status_code=303)
async def revoke_key(request: Request, key_id: str = Parameter(max_length=32)) -> Response:
    session = await session_of(request)
    p = session.principal
    await form_of(request, session)
    services = request.app.state.services
    back = _BACK_RE.search(request.headers.get("referer", ""))
    target = f"/console/tenants/{back.group(1)}" if back else "/console/keys"
    if p.is_admin and key_id == p.key_id:
        # as over HTTP (409 own_key): the operator's own admin key would lock the console out
        return redirect(request, target, error=f"Key {key_id} is the admin key of this session and was not revoked: "
                                               f"sign in with another admin key, or run 'loraplex admin key revoke "
                                               f"{key_id}' on the server.")
    async with services.sessions() as s:
        # a tenant's lookup is scoped to itself: another tenant's key id is a 404 like an unknown one
        key = await svc.revoke_key(s, services.kv, key_id, None if p.is_admin else p.tenant_id)
    note = " That was the key of this session: sign in again." if key.id == p.key_id else ""
    # revoked from a tenant's page: go back there
    return redirect(request, target, flash=f"Key {key.id} revoked; it stops working within a second.{note}")


def handlers() -> list:
    return [keys_page, create_key, revoke_key]
