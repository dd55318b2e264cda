"""The console's view of the usage area: plans (prices, monthly token quota), quota use, usage reports.

Everything here calls the usage area's service layer (``loraplex.platform.usage``); the console keeps no
billing logic of its own. When that area is not installed the pages say so instead of failing.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from datetime import datetime

from litestar import Request

from loraplex.platform.errors import ApiError

log = logging.getLogger(__name__)

PRICE_FIELDS = ("input_per_mtok", "cached_input_per_mtok", "output_per_mtok")
INGEST_WAIT_S = 3.0  # a page waits this long for usage still in the spool (so a run just made shows up)


def usage_module(name: str):
    """``loraplex.platform.usage.<name>``, or None while the usage area is not installed."""
    try:
        return importlib.import_module(f"loraplex.platform.usage.{name}")
    except ModuleNotFoundError as exc:
        if exc.name and f"loraplex.platform.usage.{name}".startswith(exc.name):
            return None
        raise


def area(services):
    return services.extras.get("usage")


def unavailable() -> ApiError:
    return ApiError(501, "Quotas, prices and usage need the usage area, which is not running on this server.",
                    type="server_error", code="not_available")


@dataclass
class TenantPlanView:
    plan: object | None  # BillingPlan
    quota_override: int | None
    quota: int | None  # effective; None = unlimited
    used: int
    plans: list  # every plan, for the chooser

    @property
    def used_pct(self) -> float:
        return min(100.0, 100.0 * self.used / self.quota) if self.quota else 0.0


async def tenant_plan(services, tenant) -> TenantPlanView | None:
    plans, models, usage = usage_module("plans"), usage_module("models"), area(services)
    if plans is None or usage is None:
        return None
    async with services.sessions() as s:
        row = await s.get(models.TenantPlan, tenant.id)
        plan, quota = await plans.tenant_billing(s, tenant.id)
        all_plans = await plans.list_plans(s)
    used = await usage.quota.used(tenant.id)
    return TenantPlanView(plan, row.monthly_token_quota if row else None, quota, used, all_plans)


async def list_plans(services) -> list | None:
    plans = usage_module("plans")
    if plans is None or area(services) is None:
        return None
    async with services.sessions() as s:
        return await plans.list_plans(s)


UNLIMITED = "unlimited"  # the word that clears a quota (blank keeps or inherits it, depending on the form)
PRICE_LABELS = {"input_per_mtok": "Input / M tok", "cached_input_per_mtok": "Cached / M tok",
                "output_per_mtok": "Output / M tok"}


def _quota_field(form: dict[str, str], blank: str) -> int | None:
    """The quota typed, or None for the word "unlimited" (also for blank, which ``blank`` names on errors)."""
    from loraplex.platform.console.deps import whole_number

    raw = (form.get("monthly_token_quota") or "").strip()
    if raw.lower() == UNLIMITED:
        return None
    plans = usage_module("plans")
    limit = plans.MAX_QUOTA if plans is not None else None
    return whole_number(form, "monthly_token_quota", "Monthly token quota", minimum=0, maximum=limit,
                        unit="tokens", blank=blank + f", or '{UNLIMITED}'")


def _price_field(form: dict[str, str], name: str) -> str | None:
    """The price typed (checked with the API's rules, named by its label), or None when blank."""
    from loraplex.platform.usage.pricing import MAX_PRICE, MAX_PRICE_DECIMALS, parse_price, price_text

    raw = (form.get(name) or "").strip()
    if not raw:
        return None
    label = PRICE_LABELS[name]
    try:
        return price_text(parse_price(raw, name))
    except ApiError:
        raise ApiError(400, f"{label} must be a price between 0 and {MAX_PRICE} per million tokens with at most "
                       f"{MAX_PRICE_DECIMALS} decimal places, got {raw[:40]!r}.", param=name) from None


async def _changed(request: Request, tenant_id: str) -> None:
    # the usage area's own invalidation (its quota cache here, and on every replica over pub/sub)
    routes = usage_module("routes")
    await routes._plans_changed(request, tenant_id)


async def save_tenant_plan(request: Request, tenant, form: dict[str, str]) -> None:
    services = request.app.state.services
    plans = usage_module("plans")
    if plans is None or area(services) is None:
        raise unavailable()
    from loraplex.platform.console.deps import whole_number

    quota = whole_number(form, "monthly_token_quota", "Monthly token quota", minimum=0, maximum=plans.MAX_QUOTA,
                         unit="tokens", blank="blank = the plan's quota")
    fields = {"plan": form.get("plan") or None, "monthly_token_quota": quota}
    async with services.sessions() as s:
        await plans.set_tenant_plan(s, tenant.id, fields)
    await _changed(request, tenant.id)


async def save_plan(request: Request, form: dict[str, str]) -> str:
    """Create the plan, or update its prices and quota when one of that name exists; returns its name."""
    services = request.app.state.services
    plans = usage_module("plans")
    if plans is None or area(services) is None:
        raise unavailable()
    name = (form.get("name") or "").strip()
    async with services.sessions() as s:
        exists = name in {p.name for p in await plans.list_plans(s)}
        # on a plan that exists a blank field keeps its value; on a new one it means 0 (prices) or unlimited
        fields: dict = {}
        if (form.get("monthly_token_quota") or "").strip() or not exists:
            fields["monthly_token_quota"] = _quota_field(form, "blank = keep" if exists else "blank = unlimited")
        for price in PRICE_FIELDS:
            value = _price_field(form, price)
            if value is not None or not exists:
                fields[price] = value or "0"
        currency = (form.get("currency") or "").strip().upper()
        if currency:
            fields["currency"] = currency
        if exists:
            await plans.update_plan(s, name, fields)
        else:
            await plans.create_plan(s, name, fields)
    await _changed(request, "*")
    return name


async def wait_ingested(services, end: datetime) -> bool:
    """Let usage still in the spool reach the ledger (bounded); False when some is still pending."""
    usage = area(services)
    if usage is None:
        return True
    from loraplex.platform.db import utcnow

    return await usage.sink.wait_ingested_before(min(end, utcnow()), INGEST_WAIT_S)
