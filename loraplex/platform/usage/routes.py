"""Usage and billing routes: ``GET /v1/usage`` (a tenant's own), ``GET /admin/usage/export`` (streamed CSV
or JSON lines), ``/admin/plans`` and ``/admin/tenant-plans/{tenant}``. ``setup`` installs the ledger
sink and the quota gate on the platform's services."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime

from litestar import Request, Router, delete, get, patch, post, put
from litestar.openapi.spec import (
    OpenAPIHeader,
    OpenAPIMediaType,
    OpenAPIResponse,
    OpenAPIType,
    Operation,
    Schema,
)
from litestar.params import Parameter
from litestar.response import Stream

from loraplex.platform.auth import principal_of, require_scope
from loraplex.platform.db import as_utc, utcnow
from loraplex.platform.errors import bad_request, error_responses
from loraplex.platform.models import SCOPE_ADMIN
from loraplex.platform.tenants import get_tenant
from loraplex.platform.usage import aggregate, export, plans
from loraplex.platform.usage import schemas as w
from loraplex.platform.usage.models import TenantPlan
from loraplex.platform.usage.pricing import month_bounds
from loraplex.platform.usage.quota import QuotaTracker
from loraplex.platform.usage.sink import LedgerSink

log = logging.getLogger(__name__)

SPOOL_DIR = "usage-spool"  # under data_dir
PLAN_CHANNEL = "usage:plans"  # pub/sub: a plan or assignment changed (payload: tenant id or "*")
EXPORT_WAIT_S = 10.0  # how long an export waits for events of its window still in the spool
_ERR = error_responses(400, 401, 403, 404, 409)


class UsageArea:
    def __init__(self, sink: LedgerSink, quota: QuotaTracker):
        self.sink, self.quota = sink, quota
        self.subscription = None


def area(request: Request) -> UsageArea:
    return request.app.state.services.extras["usage"]


# ---- shared ---------------------------------------------------------------------------------------


async def _complete(request: Request, end: datetime) -> bool:
    """Wait (bounded) until this process's events before ``min(end, now)`` are in the ledger."""
    return await area(request).sink.wait_ingested_before(min(end, utcnow()), EXPORT_WAIT_S)


async def _quota_out(request: Request, tenant_id: str) -> w.QuotaOut:
    tracker = area(request).quota
    start, end = month_bounds(utcnow())
    quota = await tracker.quota_of(tenant_id)
    used = await tracker.used(tenant_id)
    return w.QuotaOut(quota, used, None if quota is None else max(0, quota - used), start, end)


def _plan_out(p) -> w.PlanOut:
    return w.PlanOut(
        id=p.id, name=p.name, currency=p.currency, input_per_mtok=p.input_per_mtok,
        cached_input_per_mtok=p.cached_input_per_mtok, output_per_mtok=p.output_per_mtok,
        adapter_surcharges=dict(p.adapter_surcharges or {}), monthly_token_quota=p.monthly_token_quota,
        created_at=as_utc(p.created_at), updated_at=as_utc(p.updated_at),
    )


async def _plans_changed(request: Request, tenant_id: str = "*") -> None:
    services = request.app.state.services
    area(request).quota.invalidate(None if tenant_id == "*" else tenant_id)
    try:  # other replicas drop their cached quota too
        await services.kv.publish(PLAN_CHANNEL, tenant_id)
    except Exception:
        log.warning("could not publish a plan change; other replicas pick it up within their cache TTL")


_FROM = Parameter(query="from", default=None, max_length=40, description="ISO date or date-time (UTC if naive); "
                  "default: start of the current month")
_TO = Parameter(query="to", default=None, max_length=40, description="exclusive; default: start of next month")
_GROUP = Parameter(query="group_by", default="day", description="day | adapter | key")


# ---- tenants: their own usage -----------------------------------------------------------------------


@get("/v1/usage", responses=error_responses(400, 401), tags=["usage"], summary="Your usage and quota")
async def my_usage(request: Request, start: str | None = _FROM, end: str | None = _TO,
                   group_by: str = _GROUP) -> w.UsageReport:
    """Totals of the calling key's tenant only, grouped by day, adapter or key, with costs and quota."""
    principal = await principal_of(request)
    lo, hi = aggregate.window(start, end)
    q = aggregate.Query(lo, hi, group_by, principal.tenant_id)
    complete = await _complete(request, hi)
    items = [r async for r in aggregate.rows(request.app.state.services.sessions, q)]
    return w.UsageReport(
        start=lo, end=hi, group_by=group_by, complete=complete, data=[w.UsageRow(**i) for i in items],
        totals=w.UsageTotals(**aggregate.totals(items)), quota=await _quota_out(request, principal.tenant_id),
    )


# ---- admin: exports -------------------------------------------------------------------------------


@dataclass
class _ExportOperation(Operation):
    """The export's 200 is CSV or JSON lines (not JSON), with ``x-usage-complete``: say so in OpenAPI."""

    def __post_init__(self) -> None:
        ok = (self.responses or {}).get("200")
        if isinstance(ok, OpenAPIResponse):
            text = Schema(type=OpenAPIType.STRING)
            ok.description = "Aggregated usage rows, streamed"
            ok.content = {media: OpenAPIMediaType(schema=text) for media in export.MEDIA_TYPES.values()}
            ok.headers = {
                "x-usage-complete": OpenAPIHeader(schema=Schema(type=OpenAPIType.STRING, enum=["true", "false"]),
                                                  description="every event of the window had reached the ledger"),
                "content-disposition": OpenAPIHeader(schema=text, description="attachment; filename=..."),
            }


@get("/usage/export", responses=_ERR, summary="Export usage (streamed CSV or JSON lines)",
     operation_class=_ExportOperation)
async def export_usage(
    request: Request, start: str | None = _FROM, end: str | None = _TO, group_by: str = _GROUP,
    tenant: str | None = Parameter(query="tenant", default=None, max_length=64, description="name or id"),
    fmt: str = Parameter(query="format", default="csv", description="csv | jsonl"),
) -> Stream:
    """Windows are half-open on the request's end time: consecutive windows never share a request.
    ``x-usage-complete: false`` means events of the window were still spooled after the wait."""
    services = request.app.state.services
    if fmt not in aggregate.FORMATS:
        raise bad_request(f"format must be one of {', '.join(aggregate.FORMATS)}, got {fmt!r}.", param="format")
    lo, hi = aggregate.window(start, end)
    tenant_id = None
    if tenant:
        async with services.sessions() as s:
            tenant_id = (await get_tenant(s, tenant)).id
    q = aggregate.Query(lo, hi, group_by, tenant_id)
    complete = await _complete(request, hi)
    name = f"usage_{lo:%Y%m%dT%H%M%S}_{hi:%Y%m%dT%H%M%S}_{group_by}.{fmt}"
    return Stream(export.encode(services.sessions, q, fmt), media_type=export.MEDIA_TYPES[fmt], headers={
        "content-disposition": f'attachment; filename="{name}"', "x-usage-complete": str(complete).lower(),
    })


# ---- admin: plans ---------------------------------------------------------------------------------

_PLAN = Parameter(description="plan name or id", max_length=64)
_TENANT = Parameter(description="tenant name or id", max_length=64)


@post("/plans", status_code=201, responses=_ERR, summary="Create a billing plan")
async def create_plan(request: Request, data: w.PlanCreate) -> w.PlanOut:
    async with request.app.state.services.sessions() as s:
        fields = {k: v for k, v in w.fields_of(data).items() if k != "name"}
        return _plan_out(await plans.create_plan(s, data.name, fields))


@get("/plans", responses=_ERR, summary="List billing plans")
async def list_plans(request: Request) -> w.PlanList:
    async with request.app.state.services.sessions() as s:
        return w.PlanList(data=[_plan_out(p) for p in await plans.list_plans(s)])


@get("/plans/{plan:str}", responses=_ERR, summary="Get a billing plan")
async def get_plan(request: Request, plan: str = _PLAN) -> w.PlanOut:
    async with request.app.state.services.sessions() as s:
        return _plan_out(await plans.get_plan(s, plan))


@patch("/plans/{plan:str}", responses=_ERR, summary="Change a plan's prices, surcharges or quota")
async def update_plan(request: Request, data: w.PlanUpdate, plan: str = _PLAN) -> w.PlanOut:
    """Prices apply to every export taken afterwards, including past windows."""
    async with request.app.state.services.sessions() as s:
        out = _plan_out(await plans.update_plan(s, plan, w.fields_of(data)))
    await _plans_changed(request)
    return out


@delete("/plans/{plan:str}", status_code=204, responses=_ERR, summary="Delete an unused plan")
async def delete_plan(request: Request, plan: str = _PLAN) -> None:
    async with request.app.state.services.sessions() as s:
        await plans.delete_plan(s, plan)


async def _tenant_plan_out(request: Request, tenant, row) -> w.TenantPlanOut:
    async with request.app.state.services.sessions() as s:
        plan, _ = await plans.tenant_billing(s, tenant.id)
    return w.TenantPlanOut(
        tenant=tenant.name, tenant_id=tenant.id, plan=_plan_out(plan) if plan else None,
        monthly_token_quota_override=row.monthly_token_quota if row else None,
        quota=await _quota_out(request, tenant.id),
    )


@get("/tenant-plans/{tenant:str}", responses=_ERR, summary="A tenant's plan and quota usage")
async def get_tenant_plan(request: Request, tenant: str = _TENANT) -> w.TenantPlanOut:
    async with request.app.state.services.sessions() as s:
        t = await get_tenant(s, tenant)
        row = await s.get(TenantPlan, t.id)
    return await _tenant_plan_out(request, t, row)


@put("/tenant-plans/{tenant:str}", responses=_ERR, summary="Put a tenant on a plan and/or override its quota")
async def set_tenant_plan(request: Request, data: w.TenantPlanUpdate, tenant: str = _TENANT) -> w.TenantPlanOut:
    async with request.app.state.services.sessions() as s:
        t, row = await plans.set_tenant_plan(s, tenant, w.fields_of(data))
    await _plans_changed(request, t.id)
    return await _tenant_plan_out(request, t, row)


# ---- wiring ---------------------------------------------------------------------------------------


def route_handlers() -> list:
    return [
        my_usage,
        Router(
            path="/admin", guards=[require_scope(SCOPE_ADMIN)], tags=["usage"], security=[{"bearer": []}],
            route_handlers=[export_usage, create_plan, list_plans, get_plan, update_plan, delete_plan,
                            get_tenant_plan, set_tenant_plan],
        ),
    ]


async def setup(services) -> None:
    tracker = QuotaTracker(services.sessions, sink=None)
    sink = LedgerSink(services.sessions, services.settings.data_path / SPOOL_DIR, on_ingested=tracker.on_ingested)
    tracker.sink = sink
    await sink.start()
    services.usage = sink
    services.quota = tracker
    usage = UsageArea(sink, tracker)
    services.extras["usage"] = usage

    def on_plan_change(message: str) -> None:
        tracker.invalidate(None if message == "*" else message)

    try:
        usage.subscription = await services.kv.subscribe(PLAN_CHANNEL, on_plan_change)
    except Exception:
        log.warning("no plan-change subscription (KV unavailable); quotas refresh within their cache TTL")


async def teardown(services) -> None:
    usage: UsageArea | None = services.extras.get("usage")
    if usage is None:
        return
    if usage.subscription is not None:
        await usage.subscription.close()
    await usage.sink.stop()
