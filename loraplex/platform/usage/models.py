"""Usage tables: the ledger (one row per request, ``request_id`` unique), billing plans, tenant plans.

Prices are stored as decimal *strings* (SQLite has no exact decimal type) and only ever turned into
:class:`decimal.Decimal`; a float never touches money. The ledger has no foreign key to tenants on
purpose: billing records outlive a deleted tenant.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import JSON, BigInteger, DateTime, Float, ForeignKey, Index, Integer, String
from sqlalchemy.orm import Mapped, mapped_column

from loraplex.platform.db import Base, new_id, utcnow


class UsageRecord(Base):
    __tablename__ = "usage_records"
    __table_args__ = (Index("ix_usage_records_tenant_created", "tenant_id", "created_at"),)

    request_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(32), nullable=False)
    tenant_name: Mapped[str] = mapped_column(String(64), nullable=False)
    key_id: Mapped[str] = mapped_column(String(16), nullable=False)
    model: Mapped[str] = mapped_column(String(256), nullable=False)
    endpoint: Mapped[str] = mapped_column(String(32), nullable=False)
    adapter_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    adapter_version: Mapped[int | None] = mapped_column(Integer, nullable=True)
    adapter_name: Mapped[str | None] = mapped_column(String(256), nullable=True)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, nullable=False)
    cached_prompt_tokens: Mapped[int] = mapped_column(BigInteger, nullable=False)
    completion_tokens: Mapped[int] = mapped_column(BigInteger, nullable=False)
    status: Mapped[str] = mapped_column(String(16), nullable=False)
    finish_reason: Mapped[str | None] = mapped_column(String(32), nullable=True)
    queue_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    ttft_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    total_s: Mapped[float] = mapped_column(Float, nullable=False)
    # when the request ended: the billing time (export windows and months are cut on it)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False, index=True)
    # when the ledger received it (lag diagnostics)
    recorded_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False, default=utcnow)


class BillingPlan(Base):
    __tablename__ = "billing_plans"

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    name: Mapped[str] = mapped_column(String(64), unique=True, nullable=False)
    currency: Mapped[str] = mapped_column(String(3), nullable=False, default="USD")
    # prices per million tokens, decimal strings
    input_per_mtok: Mapped[str] = mapped_column(String(40), nullable=False, default="0")
    cached_input_per_mtok: Mapped[str] = mapped_column(String(40), nullable=False, default="0")
    output_per_mtok: Mapped[str] = mapped_column(String(40), nullable=False, default="0")
    # added per million (prompt + completion) tokens of a request that used an adapter:
    # {"*": default for any adapter, "<adapter_id>": for that adapter}
    adapter_surcharges: Mapped[dict[str, str]] = mapped_column(JSON, nullable=False, default=dict)
    monthly_token_quota: Mapped[int | None] = mapped_column(BigInteger, nullable=True)  # None = unlimited
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False, default=utcnow)


class TenantPlan(Base):
    __tablename__ = "tenant_plans"

    tenant_id: Mapped[str] = mapped_column(
        String(32), ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True
    )
    plan_id: Mapped[str | None] = mapped_column(
        String(32), ForeignKey("billing_plans.id", ondelete="RESTRICT"), nullable=True, index=True
    )
    # overrides the plan's quota for this tenant; None = the plan's
    monthly_token_quota: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False, default=utcnow)
