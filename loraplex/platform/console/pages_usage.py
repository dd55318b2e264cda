"""Usage: tokens by day and by adapter (SVG bar charts), totals and cost, quota, exports.

Numbers come from the usage area's aggregation (``loraplex.platform.usage.aggregate``) and exports from
its encoder; the console picks the window and the tenant. A tenant only ever sees its own: the tenant
filter is forced to the session's tenant, whatever the query string says.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from urllib.parse import urlencode

from litestar import Request, Response, get
from litestar.response import Stream

from loraplex.platform import tenants as tenant_svc
from loraplex.platform.console import billing, charts
from loraplex.platform.console.deps import session_of
from loraplex.platform.console.render import page
from loraplex.platform.console.session import Session
from loraplex.platform.db import utcnow
from loraplex.platform.errors import bad_request

RANGES = {"month": "This month", "30d": "Last 30 days", "7d": "Last 7 days"}
BASE_LABEL = "base model"


def window(range_key: str, now: datetime | None = None) -> tuple[datetime, datetime]:
    now = now or utcnow()
    today = datetime(now.year, now.month, now.day, tzinfo=timezone.utc)
    if range_key == "7d":
        return today - timedelta(days=6), today + timedelta(days=1)
    if range_key == "30d":
        return today - timedelta(days=29), today + timedelta(days=1)
    start = today.replace(day=1)
    end = (start + timedelta(days=32)).replace(day=1)
    return start, end


async def _scope(request: Request, session: Session) -> tuple[str | None, object | None]:
    """(tenant id to filter on, tenant row): a tenant's own always; for operators the ``tenant`` filter."""
    p = session.principal
    name = p.tenant_id if not p.is_admin else (request.query_params.get("tenant") or "").strip()
    if not name:
        return None, None
    async with request.app.state.services.sessions() as s:
        tenant = await tenant_svc.get_tenant(s, name)
    return tenant.id, tenant


def _range(request: Request) -> str:
    key = request.query_params.get("range") or "month"
    if key not in RANGES:
        raise bad_request(f"range must be one of {', '.join(RANGES)}, got {key!r}.", param="range")
    return key


def adapter_label(row: dict, show_tenant: bool, viewer: str | None = None) -> str:
    """The chart's label of a usage row. ``viewer``: the tenant whose usage this is, whose own adapters are shown
    without the owner (another tenant's adapter of the same name keeps it: the two are different adapters)."""
    if not row.get("adapter_id"):
        return BASE_LABEL + (f" ({row['tenant']})" if show_tenant else "")
    # adapter_name is "<owner>/<adapter>"
    name = row.get("adapter_name") or row.get("model") or row["adapter_id"]
    owner, slash, bare = name.partition("/")
    if not show_tenant and slash and owner == viewer:
        return bare
    return name


@get("/usage", include_in_schema=False)
async def usage_page(request: Request) -> Response:
    session = await session_of(request)
    services = request.app.state.services
    aggregate = billing.usage_module("aggregate")
    if aggregate is None or billing.area(services) is None:
        return page(request, "usage.html", session, active="usage", report=None)
    range_key = _range(request)
    tenant_id, tenant = await _scope(request, session)
    lo, hi = window(range_key)
    complete = await billing.wait_ingested(services, hi)
    by_day = [r async for r in aggregate.rows(services.sessions, aggregate.Query(lo, hi, "day", tenant_id))]
    by_adapter = [r async for r in aggregate.rows(services.sessions, aggregate.Query(lo, hi, "adapter", tenant_id))]
    days: dict[str, tuple[int, int]] = {}
    for r in by_day:
        p, c = days.get(r["day"], (0, 0))
        days[r["day"]] = (p + r["prompt_tokens"], c + r["completion_tokens"])
    show_tenant = session.principal.is_admin and tenant_id is None
    adapters: dict[str, tuple[int, int]] = {}
    for r in by_adapter:
        label = adapter_label(r, show_tenant, tenant.name if tenant is not None else None)
        t, n = adapters.get(label, (0, 0))
        adapters[label] = (t + r["total_tokens"], n + r["requests"])
    plan = await billing.tenant_plan(services, tenant) if tenant is not None else None
    tenants = []
    if session.principal.is_admin:
        async with services.sessions() as s:
            tenants = [t.name for t in await tenant_svc.list_tenants(s)]
    query = {"range": range_key, **({"tenant": tenant.name} if tenant is not None and session.principal.is_admin
                                    else {})}
    return page(
        request, "usage.html", session, active="usage", report=True, range_key=range_key, ranges=RANGES,
        start=lo, end=hi, complete=complete, totals=aggregate.totals(by_day),
        day_chart=charts.day_chart(lo.date(), min(hi, lo + timedelta(days=31)).date(), days),
        adapter_chart=charts.adapter_chart(adapters), by_adapter=by_adapter, tenant=tenant, tenants=tenants,
        plan=plan, show_tenant=show_tenant, export_query=urlencode(query), adapter_label=adapter_label,
    )


@get("/usage/export", include_in_schema=False)
async def usage_export(request: Request) -> Stream:
    """Aggregated usage as CSV or JSON lines (the usage area's export encoder), own tenant for tenants."""
    session = await session_of(request)
    services = request.app.state.services
    aggregate, export = billing.usage_module("aggregate"), billing.usage_module("export")
    if aggregate is None or export is None or billing.area(services) is None:
        raise billing.unavailable()
    fmt = request.query_params.get("format") or "csv"
    if fmt not in aggregate.FORMATS:
        raise bad_request(f"format must be one of {', '.join(aggregate.FORMATS)}, got {fmt!r}.", param="format")
    group_by = request.query_params.get("group_by") or "day"
    range_key = _range(request)
    tenant_id, tenant = await _scope(request, session)
    lo, hi = window(range_key)
    q = aggregate.Query(lo, hi, group_by, tenant_id)  # validates group_by
    complete = await billing.wait_ingested(services, hi)
    who = tenant.name if tenant is not None else "all"
    name = f"usage_{who}_{lo:%Y%m%d}_{hi:%Y%m%d}_{group_by}.{fmt}"
    return Stream(export.encode(services.sessions, q, fmt), media_type=export.MEDIA_TYPES[fmt], headers={
        "content-disposition": f'attachment; filename="{name}"', "x-usage-complete": str(complete).lower(),
        "cache-control": "no-store",
    })


def handlers() -> list:
    return [usage_page, usage_export]
