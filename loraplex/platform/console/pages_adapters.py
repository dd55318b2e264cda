"""Adapters: list, upload (the browser posts to the registry's ``/v1/adapters`` through the console proxy,
with a progress bar), validation status and errors per version, visibility, delete.

Reads and writes go through the adapter registry's service layer (``loraplex.platform.registry``); the
console only decides who may look at which page. A tenant's page for an adapter of another tenant
answers 404 exactly like a missing one. An operator sees every tenant's adapters and may change or
delete them on the owner's behalf.
"""

from __future__ import annotations

from litestar import Request, Response, get, post
from litestar.params import Parameter
from sqlalchemy import select

from loraplex.platform import tenants as tenant_svc
from loraplex.platform.auth import Principal
from loraplex.platform.console.deps import form_of, session_of
from loraplex.platform.console.render import page, redirect
from loraplex.platform.console.session import Session
from loraplex.platform.errors import ApiError, forbidden, not_found
from loraplex.platform.models import SCOPE_ADAPTERS_WRITE, SCOPE_ADMIN
from loraplex.platform.registry import queries
from loraplex.platform.registry.models import VISIBILITIES, Adapter
from loraplex.platform.registry.schemas import adapter_out
from loraplex.platform.registry.setup import registry_of

ADMIN_LIST_LIMIT = 300
_OWNER = Parameter()  # any length: unknown names are a 404
_NAME = Parameter()


async def _all_adapters(session) -> list[queries.Listed]:
    """Every tenant's live adapters (operators), through the registry's own per-adapter read."""
    rows = (await session.execute(
        select(Adapter.tenant_id, Adapter.name).where(Adapter.deleted_at.is_(None))
        .order_by(Adapter.tenant_id, Adapter.name).limit(ADMIN_LIST_LIMIT)
    )).all()
    out = []
    for tenant_id, name in rows:
        item = await queries.get_own(session, tenant_id, name)
        if item is not None:
            out.append(item)
    return out


@get("/adapters", include_in_schema=False)
async def adapters_page(request: Request) -> Response:
    session = await session_of(request)
    p = session.principal
    async with request.app.state.services.sessions() as s:
        # operators: every tenant's (public and shared ones included); tenants: own + shared with them
        items = await _all_adapters(s) if p.is_admin else await queries.list_usable(s, p)
        # a tenant's list holds only what it can call; an operator's, every tenant's adapters: the registry's own
        # rule says which of those the operator's key can call
        usable = set((await s.execute(select(Adapter.id).where(Adapter.deleted_at.is_(None),
                                                               queries.usable_by(p.tenant_id)))).scalars()) \
            if p.is_admin else None
    adapters = [(adapter_out(i, p.tenant_id), i.adapter.tenant_id == p.tenant_id,
                 usable is None or i.adapter.id in usable) for i in items]
    uploaded = request.query_params.get("uploaded")
    return page(request, "adapters.html", session, active="adapters", adapters=adapters, uploaded=uploaded,
                can_write=p.has_scope(SCOPE_ADAPTERS_WRITE), visibilities=VISIBILITIES,
                max_upload_bytes=request.app.state.services.settings.max_upload_bytes)


async def _owned(request: Request, session: Session, owner: str, name: str) -> tuple[queries.Listed, Principal]:
    """The adapter and the principal to act as: its owner tenant. Others' adapters are a 404 for tenants."""
    p = session.principal
    async with request.app.state.services.sessions() as s:
        tenant = None
        if p.is_admin or owner == p.tenant_name:
            try:
                tenant = await tenant_svc.get_tenant(s, owner)
            except ApiError:
                tenant = None
        item = await queries.get_own(s, tenant.id, name) if tenant is not None else None
    if item is None or tenant is None or (not p.is_admin and tenant.id != p.tenant_id):
        raise not_found(f"No adapter '{owner}/{name}'.", param="name")
    if tenant.id == p.tenant_id:
        return item, p
    # an operator acting on a tenant's adapter, on the owner's behalf
    return item, Principal(tenant_id=tenant.id, tenant_name=tenant.name, key_id=p.key_id,
                           scopes=frozenset({SCOPE_ADMIN}))


@get("/adapters/{owner:str}/{name:str}", include_in_schema=False)
async def adapter_page(request: Request, owner: str = _OWNER, name: str = _NAME) -> Response:
    session = await session_of(request)
    item, acting = await _owned(request, session, owner, name)
    out = adapter_out(item, acting.tenant_id)
    own = acting.tenant_id == session.principal.tenant_id
    model = out.model if own else f"{out.owner}/{out.name}"
    async with request.app.state.services.sessions() as s:
        tenants = [t.name for t in await tenant_svc.list_tenants(s) if t.id != acting.tenant_id] \
            if session.principal.is_admin else []
    return page(request, "adapter.html", session, active="adapters", a=out, owner=owner, model=model,
                own=own, can_write=session.principal.has_scope(SCOPE_ADAPTERS_WRITE), visibilities=VISIBILITIES,
                tenant_names=tenants)


@post("/adapters/{owner:str}/{name:str}/settings", include_in_schema=False, status_code=303)
async def adapter_settings(request: Request, owner: str = _OWNER, name: str = _NAME) -> Response:
    session = await session_of(request)
    form = await form_of(request, session)
    item, acting = await _owned(request, session, owner, name)
    _check_write(session)
    registry = registry_of(request)
    shared = [t.strip() for t in (form.get("shared_with") or "").split(",") if t.strip()]
    visibility = form.get("visibility") or item.adapter.visibility
    if visibility == "private" and shared:  # the API's 400; dropping the list would look saved and share nothing
        raise ApiError(400, "Shared with names tenants but Visibility is 'private', which shares with no one: "
                       "choose Visibility 'shared', or empty Shared with.", param="shared_with")
    meta = await registry.check_metadata(acting, form.get("description"), visibility,
                                         shared if visibility == "shared" else [])
    await registry.update(acting, item.adapter.name, meta)
    return redirect(request, f"/console/adapters/{owner}/{name}", flash="Adapter settings saved.")


@post("/adapters/{owner:str}/{name:str}/delete", include_in_schema=False, status_code=303)
async def adapter_delete(request: Request, owner: str = _OWNER, name: str = _NAME) -> Response:
    session = await session_of(request)
    form = await form_of(request, session)
    item, acting = await _owned(request, session, owner, name)
    _check_write(session)
    version = form.get("version") or ""
    numbered = version.isdecimal()  # what int() reads ('²' is a digit it refuses)
    await registry_of(request).delete(acting, item.adapter.name, int(version) if numbered else None)
    if numbered:
        return redirect(request, f"/console/adapters/{owner}/{name}", flash=f"Version {version} deleted.")
    return redirect(request, "/console/adapters", flash=f"Adapter '{owner}/{name}' deleted.")


def _check_write(session: Session) -> None:
    if not session.principal.has_scope(SCOPE_ADAPTERS_WRITE):
        raise forbidden("This API key lacks the scope adapters:write.")


def handlers() -> list:
    return [adapters_page, adapter_page, adapter_settings, adapter_delete]
