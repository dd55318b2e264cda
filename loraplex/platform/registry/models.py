"""Registry tables: an adapter (per tenant and name), its versions, and the tenants it is shared with.

A version's integer primary key is the engine-facing ``lora_int_id``: unique, positive and never reused,
so the engine's caches (host, GPU slots, prefix cache) can never confuse two uploads.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import (
    JSON,
    BigInteger,
    CheckConstraint,
    DateTime,
    ForeignKey,
    Integer,
    String,
    UniqueConstraint,
)
from sqlalchemy.orm import Mapped, mapped_column

from loraplex.platform.db import Base, new_id, utcnow

VISIBILITY_PRIVATE = "private"
VISIBILITY_SHARED = "shared"
VISIBILITY_PUBLIC = "public"
VISIBILITIES = (VISIBILITY_PRIVATE, VISIBILITY_SHARED, VISIBILITY_PUBLIC)

STATUS_UPLOADING = "uploading"
STATUS_VALIDATING = "validating"
STATUS_READY = "ready"
STATUS_FAILED = "failed"
STATUSES = (STATUS_UPLOADING, STATUS_VALIDATING, STATUS_READY, STATUS_FAILED)


class Adapter(Base):
    """One name in one tenant. Deleting is soft (``deleted_at``); uploading the name again revives the
    row and continues its version numbers, so ``name@N`` never names two different contents."""

    __tablename__ = "adapters"
    __table_args__ = (
        UniqueConstraint("tenant_id", "name", name="uq_adapters_tenant_id_name"),
        CheckConstraint("visibility IN ('private', 'shared', 'public')", name="visibility"),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    tenant_id: Mapped[str] = mapped_column(
        String(32), ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False, index=True
    )
    name: Mapped[str] = mapped_column(String(64), nullable=False)
    description: Mapped[str | None] = mapped_column(String(1024), nullable=True)
    visibility: Mapped[str] = mapped_column(String(16), nullable=False, default=VISIBILITY_PRIVATE)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False, default=utcnow)
    deleted_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class AdapterVersion(Base):
    __tablename__ = "adapter_versions"
    __table_args__ = (
        UniqueConstraint("adapter_id", "version", name="uq_adapter_versions_adapter_id_version"),
        CheckConstraint("status IN ('uploading', 'validating', 'ready', 'failed')", name="status"),
        # SQLite would otherwise reuse the largest id after a hard delete (a tenant's cascade), handing the
        # engine an id it may still cache for other content; Postgres sequences never reuse
        {"sqlite_autoincrement": True},
    )

    # the engine's lora_int_id
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    adapter_id: Mapped[str] = mapped_column(
        String(32), ForeignKey("adapters.id", ondelete="CASCADE"), nullable=False, index=True
    )
    version: Mapped[int] = mapped_column(Integer, nullable=False)
    status: Mapped[str] = mapped_column(String(16), nullable=False, default=STATUS_UPLOADING)
    error: Mapped[str | None] = mapped_column(String(2048), nullable=True)
    digest: Mapped[str | None] = mapped_column(String(64), nullable=True, index=True)  # sha256 of the content
    size_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    rank: Mapped[int | None] = mapped_column(Integer, nullable=True)
    target_modules: Mapped[list[str] | None] = mapped_column(JSON, nullable=True)
    dtype: Mapped[str | None] = mapped_column(String(8), nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False, default=utcnow)
    ready_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    deleted_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class AdapterShare(Base):
    """A tenant *name* an adapter with visibility ``shared`` is shared with.

    By name, not tenant id, and without a foreign key: sharing with a name must answer the same whether a
    tenant of that name exists or not (an owner must not learn which tenants exist), so a name that does
    not exist yet is stored and takes effect when a tenant of that name is created."""

    __tablename__ = "adapter_shares"

    adapter_id: Mapped[str] = mapped_column(
        String(32), ForeignKey("adapters.id", ondelete="CASCADE"), primary_key=True
    )
    tenant_name: Mapped[str] = mapped_column(String(64), primary_key=True, index=True)
