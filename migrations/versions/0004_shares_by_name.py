"""registry: adapters are shared with tenant *names* (existing or not), so sharing never reveals which
tenants exist; a name that does not exist yet takes effect when a tenant of that name is created

Revision ID: 0004_shares_by_name
Revises: 0003_usage
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004_shares_by_name"
down_revision = "0003_usage"
branch_labels = None
depends_on = None


def _create(key: str, key_type, foreign_key: sa.ForeignKeyConstraint | None) -> None:
    constraints = [foreign_key] if foreign_key is not None else []
    op.create_table(
        "adapter_shares",
        sa.Column("adapter_id", sa.String(length=32), nullable=False),
        sa.Column(key, key_type, nullable=False),
        sa.ForeignKeyConstraint(
            ["adapter_id"], ["adapters.id"], name=op.f("fk_adapter_shares_adapter_id_adapters"), ondelete="CASCADE"
        ),
        *constraints,
        sa.PrimaryKeyConstraint("adapter_id", key, name=op.f("pk_adapter_shares")),
    )
    op.create_index(op.f(f"ix_adapter_shares_{key}"), "adapter_shares", [key], unique=False)


def _replace(select_sql: str, old_key: str, new_key: str, key_type, foreign_key=None) -> None:
    """Read every share, recreate the table keyed by ``new_key``, write them back (a few rows per adapter:
    simpler and the same on SQLite and PostgreSQL, where altering a primary key differs)."""
    bind = op.get_bind()
    rows = [dict(r._mapping) for r in bind.execute(sa.text(select_sql))]
    op.drop_index(op.f(f"ix_adapter_shares_{old_key}"), table_name="adapter_shares")
    op.drop_table("adapter_shares")
    _create(new_key, key_type, foreign_key)
    if rows:
        table = sa.table("adapter_shares", sa.column("adapter_id"), sa.column(new_key))
        op.bulk_insert(table, rows)


def upgrade() -> None:
    _replace("SELECT s.adapter_id AS adapter_id, t.name AS tenant_name FROM adapter_shares s "
             "JOIN tenants t ON t.id = s.tenant_id", "tenant_id", "tenant_name", sa.String(length=64))


def downgrade() -> None:
    # names no tenant has (yet) cannot be kept by a table keyed by tenant id
    _replace("SELECT s.adapter_id AS adapter_id, t.id AS tenant_id FROM adapter_shares s "
             "JOIN tenants t ON t.name = s.tenant_name", "tenant_name", "tenant_id", sa.String(length=32),
             sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], name=op.f("fk_adapter_shares_tenant_id_tenants"),
                                     ondelete="CASCADE"))
