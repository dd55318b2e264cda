"""Core tables: tenants and their API keys. Portable types only (SQLite and PostgreSQL).

Other areas (registry, usage) put their tables in their own ``models.py`` on the same
:class:`~loraplex.platform.db.Base` and add an Alembic revision after ``0001_core``.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import JSON, CheckConstraint, DateTime, ForeignKey, Integer, String
from sqlalchemy.orm import Mapped, mapped_column, relationship

from loraplex.platform.db import Base, new_id, utcnow

TENANT_ACTIVE = "active"
TENANT_SUSPENDED = "suspended"
TENANT_STATUSES = (TENANT_ACTIVE, TENANT_SUSPENDED)

SCOPE_INFERENCE = "inference"
SCOPE_ADAPTERS_WRITE = "adapters:write"
SCOPE_ADMIN = "admin"
ALL_SCOPES = (SCOPE_INFERENCE, SCOPE_ADAPTERS_WRITE, SCOPE_ADMIN)


class Tenant(Base):
    __tablename__ = "tenants"
    __table_args__ = (CheckConstraint("status IN ('active', 'suspended')", name="status"),)

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    name: Mapped[str] = mapped_column(String(64), unique=True, nullable=False)
    status: Mapped[str] = mapped_column(String(16), nullable=False, default=TENANT_ACTIVE)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False, default=utcnow)
    # per-tenant overrides of the server defaults; NULL = use Settings.default_*
    requests_per_minute: Mapped[int | None] = mapped_column(Integer, nullable=True)
    tokens_per_minute: Mapped[int | None] = mapped_column(Integer, nullable=True)

    api_keys: Mapped[list[ApiKey]] = relationship(back_populates="tenant", cascade="all, delete-orphan")


class ApiKey(Base):
    __tablename__ = "api_keys"

    # the public key id, the middle part of ``lpx-<id>-<secret>``
    id: Mapped[str] = mapped_column(String(16), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(
        String(32), ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False, index=True
    )
    # SHA-256 hex of the whole key; the secret itself is never stored
    key_hash: Mapped[str] = mapped_column(String(64), nullable=False)
    scopes: Mapped[list[str]] = mapped_column(JSON, nullable=False, default=list)
    name: Mapped[str | None] = mapped_column(String(128), nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False, default=utcnow)
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    last_used_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)

    tenant: Mapped[Tenant] = relationship(back_populates="api_keys")


class DeploymentSetting(Base):
    """A value the servers record for other processes of the deployment (the ``loraplex`` CLI) to find: one row
    per name (``platform/deployment.py``)."""

    __tablename__ = "deployment_settings"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(String(2048), nullable=False)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False, default=utcnow)
