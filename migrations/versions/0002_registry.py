"""registry: adapters, adapter versions, adapter shares

Revision ID: 0002_registry
Revises: 0001_core
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002_registry"
down_revision = "0001_core"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "adapters",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("tenant_id", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("description", sa.String(length=1024), nullable=True),
        sa.Column("visibility", sa.String(length=16), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("deleted_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint("visibility IN ('private', 'shared', 'public')", name=op.f("ck_adapters_visibility")),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_adapters_tenant_id_tenants"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_adapters")),
        sa.UniqueConstraint("tenant_id", "name", name=op.f("uq_adapters_tenant_id_name")),
    )
    op.create_index(op.f("ix_adapters_tenant_id"), "adapters", ["tenant_id"], unique=False)
    op.create_table(
        "adapter_versions",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("adapter_id", sa.String(length=32), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("error", sa.String(length=2048), nullable=True),
        sa.Column("digest", sa.String(length=64), nullable=True),
        sa.Column("size_bytes", sa.BigInteger(), nullable=True),
        sa.Column("rank", sa.Integer(), nullable=True),
        sa.Column("target_modules", sa.JSON(), nullable=True),
        sa.Column("dtype", sa.String(length=8), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ready_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("deleted_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint(
            "status IN ('uploading', 'validating', 'ready', 'failed')", name=op.f("ck_adapter_versions_status")
        ),
        sa.ForeignKeyConstraint(
            ["adapter_id"], ["adapters.id"], name=op.f("fk_adapter_versions_adapter_id_adapters"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_adapter_versions")),
        sa.UniqueConstraint("adapter_id", "version", name=op.f("uq_adapter_versions_adapter_id_version")),
        sqlite_autoincrement=True,
    )
    op.create_index(op.f("ix_adapter_versions_adapter_id"), "adapter_versions", ["adapter_id"], unique=False)
    op.create_index(op.f("ix_adapter_versions_digest"), "adapter_versions", ["digest"], unique=False)
    op.create_table(
        "adapter_shares",
        sa.Column("adapter_id", sa.String(length=32), nullable=False),
        sa.Column("tenant_id", sa.String(length=32), nullable=False),
        sa.ForeignKeyConstraint(
            ["adapter_id"], ["adapters.id"], name=op.f("fk_adapter_shares_adapter_id_adapters"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_adapter_shares_tenant_id_tenants"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("adapter_id", "tenant_id", name=op.f("pk_adapter_shares")),
    )
    op.create_index(op.f("ix_adapter_shares_tenant_id"), "adapter_shares", ["tenant_id"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_adapter_shares_tenant_id"), table_name="adapter_shares")
    op.drop_table("adapter_shares")
    op.drop_index(op.f("ix_adapter_versions_digest"), table_name="adapter_versions")
    op.drop_index(op.f("ix_adapter_versions_adapter_id"), table_name="adapter_versions")
    op.drop_table("adapter_versions")
    op.drop_index(op.f("ix_adapters_tenant_id"), table_name="adapters")
    op.drop_table("adapters")
