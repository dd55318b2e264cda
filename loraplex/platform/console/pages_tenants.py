"""Tenants (operators only): create, suspend/activate, rate limits, and (through the usage area's plan
service) billing plans with prices and a monthly token quota."""

from __future__ import annotations

from litestar import Request, Response, get, post
from litestar.params import Parameter

from loraplex.platform import tenants as svc
from loraplex.platform.console import billing
from loraplex.platform.console.deps import form_of, optional_int, require_admin, session_of
from loraplex.platform.console.render import page, redirect
from loraplex.platform.errors import not_found
from loraplex.platform.models import TENANT_ACTIVE, TENANT_SUSPENDED

_NAME = Parameter()  # any length: a name no tenant has is a 404 like any other


@get("/tenants", include_in_schema=False)
async def tenants_page(request: Request) -> Response:
    session = await session_of(request)
    require_admin(session)
    services = request.app.state.services
    async with services.sessions() as s:
        tenants = await svc.list_tenants(s)
        keys = await svc.list_keys(s)
    live_keys: dict[str, int] = {}
    for key, _ in keys:
        if key.revoked_at is None:
            live_keys[key.tenant_id] = live_keys.get(key.tenant_id, 0) + 1
    return page(request, "tenants.html", session, active="tenants", tenants=tenants, live_keys=live_keys,
                settings=services.settings, plans=await billing.list_plans(services))


@post("/tenants", include_in_schema=False, status_code=303)
async def create_tenant(request: Request) -> Response:
    session = await session_of(request)
    require_admin(session)
    form = await form_of(request, session)
    name = (form.get("name") or "").strip()
    rpm = optional_int(form, "requests_per_minute", "Requests / min")
    tpm = optional_int(form, "tokens_per_minute", "Tokens / min")
    async with request.app.state.services.sessions() as s:
        tenant = await svc.create_tenant(s, name, rpm, tpm)
    return redirect(request, f"/console/tenants/{tenant.name}", flash=f"Tenant '{tenant.name}' created. "
                    "Create an API key for it below.")


@get("/tenants/{name:str}", include_in_schema=False)
async def tenant_page(request: Request, name: str = _NAME) -> Response:
    session = await session_of(request)
    services = request.app.state.services
    async with services.sessions() as s:
        tenant = await svc.get_tenant(s, name)
        # a tenant sees its own page only; any other answers exactly like a missing one
        if not session.principal.is_admin and tenant.id != session.principal.tenant_id:
            raise not_found(f"No tenant '{name}'.", param="tenant")
        keys = [k for k, _ in await svc.list_keys(s, tenant.id)]
    plan = await billing.tenant_plan(services, tenant)
    return page(request, "tenant.html", session, active="tenants" if session.principal.is_admin else "keys",
                tenant=tenant, keys=keys, plan=plan, settings=services.settings,
                scopes=_grantable(session, tenant.name))


def _grantable(session, tenant_name: str) -> list[str]:
    from loraplex.platform.models import ALL_SCOPES, SCOPE_ADMIN

    if session.principal.is_admin:
        return [s for s in ALL_SCOPES if s != SCOPE_ADMIN or tenant_name == svc.ADMIN_TENANT]
    return [s for s in ALL_SCOPES if s in session.principal.scopes]


@post("/tenants/{name:str}/status", include_in_schema=False, status_code=303)
async def set_status(request: Request, name: str = _NAME) -> Response:
    session = await session_of(request)
    require_admin(session)
    form = await form_of(request, session)
    status = TENANT_SUSPENDED if form.get("action") == "suspend" else TENANT_ACTIVE
    services = request.app.state.services
    async with services.sessions() as s:
        tenant = await svc.set_tenant_status(s, services.kv, name, status)
    verb = "suspended: its keys stop working within a second" if status == TENANT_SUSPENDED else "re-activated"
    return redirect(request, f"/console/tenants/{tenant.name}", flash=f"Tenant '{tenant.name}' {verb}.")


@post("/tenants/{name:str}/limits", include_in_schema=False, status_code=303)
async def set_limits(request: Request, name: str = _NAME) -> Response:
    session = await session_of(request)
    require_admin(session)
    form = await form_of(request, session)
    rpm = optional_int(form, "requests_per_minute", "Requests / min")
    tpm = optional_int(form, "tokens_per_minute", "Tokens / min")
    services = request.app.state.services
    async with services.sessions() as s:
        tenant = await svc.update_tenant_limits(s, services.kv, name, rpm, tpm)
    return redirect(request, f"/console/tenants/{tenant.name}", flash="Rate limits saved.")


@post("/tenants/{name:str}/plan", include_in_schema=False, status_code=303)
async def set_plan(request: Request, name: str = _NAME) -> Response:
    session = await session_of(request)
    require_admin(session)
    form = await form_of(request, session)
    services = request.app.state.services
    async with services.sessions() as s:
        tenant = await svc.get_tenant(s, name)
    await billing.save_tenant_plan(request, tenant, form)
    return redirect(request, f"/console/tenants/{tenant.name}", flash="Plan and quota saved.")


@post("/plans", include_in_schema=False, status_code=303)
async def save_plan(request: Request) -> Response:
    session = await session_of(request)
    require_admin(session)
    form = await form_of(request, session)
    name = await billing.save_plan(request, form)
    return redirect(request, "/console/tenants", flash=f"Plan '{name}' saved; prices apply to every later export.")


def handlers() -> list:
    return [tenants_page, create_tenant, tenant_page, set_status, set_limits, set_plan, save_plan]
