"""Usage totals over a time window, grouped by day, adapter or key, with exact Decimal costs.

The database sums tokens per (tenant, group, adapter); costs are computed here from those sums with
each tenant's plan (adapter surcharges differ per adapter, hence the extra adapter split, merged back
into one output row per group). Rows come back in group order, so callers can stream them.

Grouping by adapter uses the adapter's identity (``adapter_id``, ``adapter_version``), never the ``model``
text the client typed (``adapter-0``, ``admin/adapter-0`` and ``adapter-0@1`` are one adapter); the row's
``model`` is the canonical ``<owner>/<name>@<version>``. Requests without an adapter group by their model.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import date, datetime, time, timezone
from decimal import Decimal

from sqlalchemy import String, case, cast, func, select

from loraplex.platform.db import SessionFactory, utcnow
from loraplex.platform.errors import bad_request
from loraplex.platform.models import Tenant
from loraplex.platform.registry.models import Adapter
from loraplex.platform.usage.models import BillingPlan, TenantPlan, UsageRecord
from loraplex.platform.usage.pricing import Prices, money_text, month_bounds

GROUP_BY = ("day", "adapter", "key")
FORMATS = ("csv", "jsonl")
GROUP_COLUMNS = {"day": ("day",), "adapter": ("model", "adapter_id", "adapter_name", "adapter_version"),
                 "key": ("key_id",)}
TOTAL_COLUMNS = ("requests", "completed", "aborted", "errors", "prompt_tokens", "cached_prompt_tokens",
                 "completion_tokens", "total_tokens", "currency", "cost")


def columns(group_by: str) -> list[str]:
    return ["tenant_id", "tenant", *GROUP_COLUMNS[group_by], *TOTAL_COLUMNS]


def parse_time(value: str | None, param: str) -> datetime | None:
    """ISO 8601 date or date-time; a naive value is UTC."""
    if value is None or value == "":
        return None
    try:
        if len(value) == 10:
            parsed = datetime.combine(date.fromisoformat(value), time(0))
        else:
            parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise bad_request(f"{param} must be an ISO 8601 date or date-time (e.g. 2026-11-01 or "
                          f"2026-11-01T00:00:00Z), got {value!r}.", param=param) from None
    if parsed.tzinfo is None:
        return parsed.replace(tzinfo=timezone.utc)
    try:
        return parsed.astimezone(timezone.utc)
    except OverflowError:  # year 1 at +01:00, year 9999 at -01:00: valid text, no UTC time
        raise bad_request(f"{param} is out of range: {value!r} falls outside years 1 to 9999 in UTC.",
                          param=param) from None


def window(start: str | None, end: str | None, names: tuple[str, str] = ("from", "to")) -> tuple[datetime, datetime]:
    """``from``/``to`` values -> [start, end); defaults: the current UTC month. A window that holds no time is a
    400 naming the bound that was given (``names``: how the caller calls them) and the default the other took."""
    month_start, month_end = month_bounds(utcnow())
    lo, hi = parse_time(start, "from") or month_start, parse_time(end, "to") or month_end
    if hi <= lo:
        raise bad_request(empty_window(lo, hi, start is not None, end is not None, names),
                          param=names[1] if end is not None or start is None else names[0])
    return lo, hi


def empty_window(lo: datetime, hi: datetime, start_given: bool, end_given: bool,
                 names: tuple[str, str] = ("from", "to")) -> str:
    """Why [from, to) holds no time, naming a bound that was left out and the default it took (a lone ``from`` in a
    later month met the default ``to``, the start of next month, and the message named a ``to`` never sent)."""
    def value(name: str, given: bool, when: datetime, default: str) -> str:
        stamp = when.strftime("%Y-%m-%dT%H:%M:%SZ")
        return f"{name} {stamp}" if given else f"{name} (not given: {default}, {stamp})"

    hint = "" if start_given and end_given else "; pass both for another month"
    return (f"{value(names[1], end_given, hi, 'the start of next month')} must be later than "
            f"{value(names[0], start_given, lo, 'the start of this month')}{hint}.")


@dataclass(frozen=True)
class Query:
    start: datetime
    end: datetime
    group_by: str = "day"
    tenant_id: str | None = None  # None = every tenant (admin)

    def __post_init__(self):
        if self.group_by not in GROUP_BY:
            raise bad_request(f"group_by must be one of {', '.join(GROUP_BY)}, got {self.group_by!r}.",
                              param="group_by")
        if self.end <= self.start:
            raise bad_request("to must be later than from.", param="to")


def _group_exprs(group_by: str, dialect: str) -> list:
    r = UsageRecord
    if group_by == "day":
        if dialect == "postgresql":
            day = func.to_char(func.timezone("UTC", r.created_at), "YYYY-MM-DD")
        else:  # SQLite stores UTC date-times as text: 'YYYY-MM-DD HH:MM:SS...'
            day = func.substr(cast(r.created_at, String), 1, 10)
        return [day.label("day")]
    if group_by == "adapter":
        # the typed model text only separates base-model rows; adapter rows group by identity alone
        base_model = case((r.adapter_id.is_(None), r.model), else_=r.adapter_id)
        return [r.adapter_id.label("g_adapter_id"), r.adapter_version.label("adapter_version"),
                base_model.label("g_model")]
    return [r.key_id.label("key_id")]


async def _prices(session, tenant_id: str | None) -> dict[str, Prices]:
    stmt = select(TenantPlan.tenant_id, BillingPlan).join(BillingPlan, TenantPlan.plan_id == BillingPlan.id)
    if tenant_id is not None:
        stmt = stmt.where(TenantPlan.tenant_id == tenant_id)
    return {tid: Prices.from_plan(plan) for tid, plan in (await session.execute(stmt)).all()}


def _status_count(status: str):
    return func.sum(case((UsageRecord.status == status, 1), else_=0))


async def rows(sessions: SessionFactory, q: Query) -> AsyncIterator[dict]:
    """One dict per (tenant, group), in order, with exact costs (as text)."""
    r = UsageRecord
    async with sessions() as session:
        dialect = session.bind.dialect.name
        prices = await _prices(session, q.tenant_id)
        groups = _group_exprs(q.group_by, dialect)
        stmt = (
            select(
                r.tenant_id, func.max(r.tenant_name).label("tenant"), *groups,
                r.adapter_id, func.max(r.adapter_name).label("adapter_name"),
                func.count().label("requests"), _status_count("completed").label("completed"),
                _status_count("aborted").label("aborted"), _status_count("error").label("errors"),
                func.sum(r.prompt_tokens).label("prompt_tokens"),
                func.sum(r.cached_prompt_tokens).label("cached_prompt_tokens"),
                func.sum(r.completion_tokens).label("completion_tokens"),
            )
            .where(r.created_at >= q.start, r.created_at < q.end)
            .group_by(r.tenant_id, *groups, r.adapter_id)
            .order_by(r.tenant_id, *groups, r.adapter_id)
        )
        if q.group_by == "adapter":
            # the registry's name, for rows stored without adapter_name (a join on primary keys: it can
            # neither drop nor repeat a ledger row); only ids this tenant's own requests resolved to
            stmt = (stmt.outerjoin(Adapter, Adapter.id == r.adapter_id)
                    .outerjoin(Tenant, Tenant.id == Adapter.tenant_id)
                    .add_columns(func.max(Tenant.name).label("registry_owner"),
                                 func.max(Adapter.name).label("registry_name")))
        if q.tenant_id is not None:
            stmt = stmt.where(r.tenant_id == q.tenant_id)
        group_names = [g.name for g in groups]
        current: dict | None = None
        current_key = None
        result = await session.stream(stmt)
        async for row in result.mappings():
            key = (row["tenant_id"], *(row[g] for g in group_names))
            if key != current_key:
                if current is not None:
                    yield _finish(current)
                current_key = key
                current = _start(row, q.group_by, prices.get(row["tenant_id"], Prices()))
            _add(current, row)
        if current is not None:
            yield _finish(current)


def _start(row, group_by: str, prices: Prices) -> dict:
    out = {"tenant_id": row["tenant_id"], "tenant": row["tenant"]}
    if group_by == "day":
        out["day"] = row["day"]
    elif group_by == "adapter":
        out.update(_adapter_columns(row))
    else:
        out["key_id"] = row["key_id"]
    out.update({c: 0 for c in TOTAL_COLUMNS[:7]})
    out["_prices"], out["_cost"] = prices, Decimal(0)
    return out


def _adapter_columns(row) -> dict:
    adapter_id, version = row["adapter_id"], row["adapter_version"]
    if adapter_id is None:
        return {"model": row["g_model"], "adapter_id": None, "adapter_name": None, "adapter_version": None}
    name = row["adapter_name"]
    if name is None and row["registry_name"] is not None:
        name = f"{row['registry_owner']}/{row['registry_name']}"
    model = name or adapter_id  # an adapter gone from the registry without a recorded name: its id
    if version is not None:
        model = f"{model}@{version}"
    return {"model": model, "adapter_id": adapter_id, "adapter_name": name, "adapter_version": version}


def _add(acc: dict, row) -> None:
    for c in ("requests", "completed", "aborted", "errors", "prompt_tokens", "cached_prompt_tokens",
              "completion_tokens"):
        acc[c] += int(row[c] or 0)
    acc["_cost"] += acc["_prices"].cost(int(row["prompt_tokens"] or 0), int(row["cached_prompt_tokens"] or 0),
                                        int(row["completion_tokens"] or 0), row["adapter_id"])


def _finish(acc: dict) -> dict:
    prices, cost = acc.pop("_prices"), acc.pop("_cost")
    acc["total_tokens"] = acc["prompt_tokens"] + acc["completion_tokens"]
    acc["currency"] = prices.currency
    acc["cost"] = money_text(cost)
    return acc


def totals(items: list[dict]) -> dict:
    """Sums of a list of rows (costs summed exactly, per currency)."""
    out = {c: sum(i[c] for i in items) for c in TOTAL_COLUMNS[:8]}
    costs: dict[str, Decimal] = {}
    for i in items:
        costs[i["currency"]] = costs.get(i["currency"], Decimal(0)) + Decimal(i["cost"])
    out["cost"] = {cur: money_text(v) for cur, v in sorted(costs.items())}
    return out
