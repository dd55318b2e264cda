"""core: deployment_settings, values the servers record for the CLI (the Redis URL their auth caches listen on)

Revision ID: 0005_deployment_settings
Revises: 0004_shares_by_name
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005_deployment_settings"
down_revision = "0004_shares_by_name"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "deployment_settings",
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("value", sa.String(length=2048), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_deployment_settings")),
    )


def downgrade() -> None:
    op.drop_table("deployment_settings")
