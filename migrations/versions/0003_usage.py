"""usage: ledger, billing plans, tenant plans

Revision ID: 0003_usage
Revises: 0002_registry
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003_usage"
down_revision = "0002_registry"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "usage_records",
        sa.Column("request_id", sa.String(length=128), nullable=False),
        sa.Column("tenant_id", sa.String(length=32), nullable=False),
        sa.Column("tenant_name", sa.String(length=64), nullable=False),
        sa.Column("key_id", sa.String(length=16), nullable=False),
        sa.Column("model", sa.String(length=256), nullable=False),
        sa.Column("endpoint", sa.String(length=32), nullable=False),
        sa.Column("adapter_id", sa.String(length=64), nullable=True),
        sa.Column("adapter_version", sa.Integer(), nullable=True),
        sa.Column("adapter_name", sa.String(length=256), nullable=True),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("cached_prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("finish_reason", sa.String(length=32), nullable=True),
        sa.Column("queue_s", sa.Float(), nullable=True),
        sa.Column("ttft_s", sa.Float(), nullable=True),
        sa.Column("total_s", sa.Float(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("recorded_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("request_id", name=op.f("pk_usage_records")),
    )
    op.create_index(op.f("ix_usage_records_created_at"), "usage_records", ["created_at"], unique=False)
    op.create_index("ix_usage_records_tenant_created", "usage_records", ["tenant_id", "created_at"], unique=False)
    op.create_table(
        "billing_plans",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("currency", sa.String(length=3), nullable=False),
        sa.Column("input_per_mtok", sa.String(length=40), nullable=False),
        sa.Column("cached_input_per_mtok", sa.String(length=40), nullable=False),
        sa.Column("output_per_mtok", sa.String(length=40), nullable=False),
        sa.Column("adapter_surcharges", sa.JSON(), nullable=False),
        sa.Column("monthly_token_quota", sa.BigInteger(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_billing_plans")),
        sa.UniqueConstraint("name", name=op.f("uq_billing_plans_name")),
    )
    op.create_table(
        "tenant_plans",
        sa.Column("tenant_id", sa.String(length=32), nullable=False),
        sa.Column("plan_id", sa.String(length=32), nullable=True),
        sa.Column("monthly_token_quota", sa.BigInteger(), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["plan_id"], ["billing_plans.id"], name=op.f("fk_tenant_plans_plan_id_billing_plans"),
                                ondelete="RESTRICT"),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], name=op.f("fk_tenant_plans_tenant_id_tenants"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("tenant_id", name=op.f("pk_tenant_plans")),
    )
    op.create_index(op.f("ix_tenant_plans_plan_id"), "tenant_plans", ["plan_id"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_tenant_plans_plan_id"), table_name="tenant_plans")
    op.drop_table("tenant_plans")
    op.drop_table("billing_plans")
    op.drop_index("ix_usage_records_tenant_created", table_name="usage_records")
    op.drop_index(op.f("ix_usage_records_created_at"), table_name="usage_records")
    op.drop_table("usage_records")
