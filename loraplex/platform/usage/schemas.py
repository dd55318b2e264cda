"""Wire types of the usage and billing routes (msgspec). Prices travel as decimal strings."""

from __future__ import annotations

from datetime import datetime

import msgspec

Price = str | int | float


class PlanCreate(msgspec.Struct, kw_only=True):
    name: str
    currency: str | None = None
    input_per_mtok: Price | None = None
    cached_input_per_mtok: Price | None = None
    output_per_mtok: Price | None = None
    adapter_surcharges: dict[str, Price] | None = None  # {"*": any adapter, id or "<tenant>/<name>": that one}
    monthly_token_quota: int | None = None  # null = unlimited


class PlanUpdate(msgspec.Struct, kw_only=True):
    """Only the fields present change; ``monthly_token_quota: null`` makes the plan unlimited."""

    currency: str | msgspec.UnsetType = msgspec.UNSET
    input_per_mtok: Price | msgspec.UnsetType = msgspec.UNSET
    cached_input_per_mtok: Price | msgspec.UnsetType = msgspec.UNSET
    output_per_mtok: Price | msgspec.UnsetType = msgspec.UNSET
    adapter_surcharges: dict[str, Price] | None | msgspec.UnsetType = msgspec.UNSET
    monthly_token_quota: int | None | msgspec.UnsetType = msgspec.UNSET


class PlanOut(msgspec.Struct):
    id: str
    name: str
    currency: str
    input_per_mtok: str
    cached_input_per_mtok: str
    output_per_mtok: str
    adapter_surcharges: dict[str, str]
    monthly_token_quota: int | None
    created_at: datetime
    updated_at: datetime
    object: str = "plan"


class PlanList(msgspec.Struct):
    data: list[PlanOut]
    object: str = "list"


class TenantPlanUpdate(msgspec.Struct, kw_only=True):
    """``plan``: a plan name or id, or null for none; ``monthly_token_quota`` overrides the plan's."""

    plan: str | None | msgspec.UnsetType = msgspec.UNSET
    monthly_token_quota: int | None | msgspec.UnsetType = msgspec.UNSET


class QuotaOut(msgspec.Struct):
    monthly_token_quota: int | None  # null = unlimited
    used_tokens: int  # this UTC month, prompt + completion
    remaining_tokens: int | None
    period_start: datetime
    period_end: datetime


class TenantPlanOut(msgspec.Struct):
    tenant: str
    tenant_id: str
    plan: PlanOut | None
    monthly_token_quota_override: int | None
    quota: QuotaOut
    object: str = "tenant_plan"


class UsageRow(msgspec.Struct, omit_defaults=True):
    tenant_id: str
    tenant: str
    requests: int
    completed: int
    aborted: int
    errors: int
    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    currency: str
    cost: str
    day: str | None = None
    model: str | None = None
    adapter_id: str | None = None
    adapter_name: str | None = None
    adapter_version: int | None = None
    key_id: str | None = None


class UsageTotals(msgspec.Struct):
    requests: int
    completed: int
    aborted: int
    errors: int
    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cost: dict[str, str]  # per currency


class UsageReport(msgspec.Struct):
    start: datetime
    end: datetime
    group_by: str
    complete: bool  # every event of the window had reached the ledger
    data: list[UsageRow]
    totals: UsageTotals
    quota: QuotaOut
    object: str = "usage"


def fields_of(struct: msgspec.Struct) -> dict:
    """The fields a client actually sent (UNSET ones dropped)."""
    return {f: getattr(struct, f) for f in struct.__struct_fields__ if getattr(struct, f) is not msgspec.UNSET}
