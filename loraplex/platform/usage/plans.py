"""Plans (prices, adapter surcharges, a monthly token quota) and which plan each tenant is on."""

from __future__ import annotations

import re

from sqlalchemy import and_, func, or_, select
from sqlalchemy.ext.asyncio import AsyncSession

from loraplex.platform.db import utcnow
from loraplex.platform.errors import ApiError, bad_request, not_found
from loraplex.platform.models import Tenant
from loraplex.platform.registry.models import Adapter
from loraplex.platform.tenants import get_tenant
from loraplex.platform.usage.models import BillingPlan, TenantPlan
from loraplex.platform.usage.pricing import ANY_ADAPTER, parse_price, price_text

PLAN_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}\Z")
CURRENCY = re.compile(r"^[A-Z]{3}\Z")
MAX_QUOTA = 10**15
MAX_SURCHARGES = 1000
PRICE_FIELDS = ("input_per_mtok", "cached_input_per_mtok", "output_per_mtok")


def check_quota(value: int | None, param: str = "monthly_token_quota") -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_QUOTA:
        raise bad_request(f"{param} must be an integer between 0 and {MAX_QUOTA} (or null for unlimited).",
                          param=param)
    return value


def check_surcharges(value: dict | None) -> dict[str, str]:
    """Key lengths and prices; which adapters the keys name is :func:`resolve_surcharge_keys`'s job."""
    if value is None:
        return {}
    if len(value) > MAX_SURCHARGES:
        raise bad_request(f"adapter_surcharges may name at most {MAX_SURCHARGES} adapters.",
                          param="adapter_surcharges")
    out = {}
    for adapter_id, price in value.items():
        if not adapter_id or len(adapter_id) > 128:
            raise bad_request("adapter_surcharges keys are \"*\", an adapter id or <tenant>/<adapter> "
                              "(at most 128 characters).", param="adapter_surcharges")
        out[adapter_id] = price_text(parse_price(price, f"adapter_surcharges[{adapter_id}]"))
    return out


async def resolve_surcharge_keys(session: AsyncSession, surcharges: dict[str, str],
                                 kept: dict[str, str] | None = None) -> dict[str, str]:
    """Keys -> adapter ids. A key must be ``*``, the id of an adapter the registry knows, or its
    ``<tenant>/<adapter>`` name (stored as the id). Soft-deleted adapters count: exports price their past
    usage with the plan of export time. Keys the plan already has (``kept``) stay valid even once their
    adapter is gone with its tenant, so re-sending a plan's own surcharges never fails."""
    kept = kept or {}
    wanted = [k for k in surcharges if k != ANY_ADAPTER and k not in kept]
    found: dict[str, str] = {}
    if wanted:
        found = {i: i for i in (await session.scalars(select(Adapter.id).where(Adapter.id.in_(wanted)))).all()}
        pairs = [tuple(k.split("/", 1)) for k in wanted if k not in found and k.count("/") == 1]
        if pairs:
            rows = await session.execute(
                select(Adapter.id, Tenant.name, Adapter.name).join(Tenant, Tenant.id == Adapter.tenant_id)
                .where(or_(*(and_(Tenant.name == t, Adapter.name == n) for t, n in pairs))))
            found.update({f"{t}/{n}": i for i, t, n in rows})
    unknown = [k for k in wanted if k not in found]
    if unknown:
        raise bad_request(f"adapter_surcharges names unknown adapter(s): {', '.join(map(repr, unknown))[:300]}; "
                          "keys are \"*\", an adapter id or <tenant>/<adapter> of an existing adapter.",
                          param="adapter_surcharges")
    out: dict[str, str] = {}
    for key, price in surcharges.items():
        adapter_id = found.get(key, key)
        if adapter_id in out:
            raise bad_request(f"adapter_surcharges names adapter {adapter_id} twice ({key!r} is the same "
                              "adapter as another key).", param="adapter_surcharges")
        out[adapter_id] = price
    return out


def apply_fields(plan: BillingPlan, fields: dict) -> None:
    """Validate and set the given plan fields (only those present); surcharges are set by :func:`_apply`."""
    for name in PRICE_FIELDS:
        if name in fields and fields[name] is not None:
            setattr(plan, name, price_text(parse_price(fields[name], name)))
    if fields.get("currency") is not None:
        if not CURRENCY.match(fields["currency"]):
            raise bad_request("currency must be a 3-letter ISO code such as USD.", param="currency")
        plan.currency = fields["currency"]
    if "monthly_token_quota" in fields:
        plan.monthly_token_quota = check_quota(fields["monthly_token_quota"])


async def _apply(session: AsyncSession, plan: BillingPlan, fields: dict) -> None:
    surcharges = check_surcharges(fields["adapter_surcharges"]) if "adapter_surcharges" in fields else None
    apply_fields(plan, fields)
    if surcharges is not None:
        plan.adapter_surcharges = await resolve_surcharge_keys(session, surcharges, plan.adapter_surcharges)


async def create_plan(session: AsyncSession, name: str, fields: dict) -> BillingPlan:
    if not PLAN_NAME.match(name or ""):
        raise bad_request("name must be 1-64 characters: lowercase letters, digits, '.', '_' or '-'.", param="name")
    if await session.scalar(select(BillingPlan).where(BillingPlan.name == name)) is not None:
        raise ApiError(409, f"A plan named '{name}' already exists.", param="name", code="conflict")
    plan = BillingPlan(name=name, currency="USD", input_per_mtok="0", cached_input_per_mtok="0",
                       output_per_mtok="0", adapter_surcharges={})
    await _apply(session, plan, fields)
    session.add(plan)
    await session.commit()
    return plan


async def get_plan(session: AsyncSession, name_or_id: str) -> BillingPlan:
    plan = await session.scalar(
        select(BillingPlan).where((BillingPlan.name == name_or_id) | (BillingPlan.id == name_or_id))
    )
    if plan is None:
        raise not_found(f"No plan '{name_or_id}'.", param="plan")
    return plan


async def list_plans(session: AsyncSession) -> list[BillingPlan]:
    return list((await session.scalars(select(BillingPlan).order_by(BillingPlan.name))).all())


async def update_plan(session: AsyncSession, name_or_id: str, fields: dict) -> BillingPlan:
    plan = await get_plan(session, name_or_id)
    await _apply(session, plan, fields)
    plan.updated_at = utcnow()
    await session.commit()
    return plan


async def delete_plan(session: AsyncSession, name_or_id: str) -> None:
    plan = await get_plan(session, name_or_id)
    users = await session.scalar(select(func.count()).select_from(TenantPlan).where(TenantPlan.plan_id == plan.id))
    if users:
        raise ApiError(409, f"Plan '{plan.name}' is assigned to {users} tenant(s); move them first.",
                       param="plan", code="conflict")
    await session.delete(plan)
    await session.commit()


async def set_tenant_plan(session: AsyncSession, tenant_name_or_id: str, fields: dict) -> tuple[Tenant, TenantPlan]:
    """Assign ``fields["plan"]`` (name/id, or None for no plan) and/or the quota override. Taking the plan away
    without naming a quota also drops the override: a tenant without a plan is free and unlimited unless the same
    request sets a quota for it."""
    tenant = await get_tenant(session, tenant_name_or_id)
    row = await session.get(TenantPlan, tenant.id)
    if row is None:
        row = TenantPlan(tenant_id=tenant.id)
        session.add(row)
    if "plan" in fields:
        row.plan_id = None if fields["plan"] is None else (await get_plan(session, fields["plan"])).id
        if fields["plan"] is None and "monthly_token_quota" not in fields:
            row.monthly_token_quota = None
    if "monthly_token_quota" in fields:
        row.monthly_token_quota = check_quota(fields["monthly_token_quota"])
    row.updated_at = utcnow()
    await session.commit()
    return tenant, row


async def tenant_billing(session: AsyncSession, tenant_id: str) -> tuple[BillingPlan | None, int | None]:
    """The tenant's plan (or None) and its effective monthly token quota (None = unlimited)."""
    row = await session.get(TenantPlan, tenant_id)
    if row is None:
        return None, None
    plan = await session.get(BillingPlan, row.plan_id) if row.plan_id else None
    quota = row.monthly_token_quota if row.monthly_token_quota is not None else (plan.monthly_token_quota if plan else None)
    return plan, quota

