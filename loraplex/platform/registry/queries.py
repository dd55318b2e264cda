"""Read side of the registry: who may see or use an adapter, listings and ``model`` lookups.

Access: the owner tenant always; another tenant when the adapter is ``public``, or ``shared`` with it.
Anything else reads exactly like a missing adapter (callers answer 404).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import and_, exists, func, or_, select
from sqlalchemy.ext.asyncio import AsyncSession

from loraplex.platform.auth import Principal
from loraplex.platform.db import as_utc
from loraplex.platform.models import Tenant
from loraplex.platform.registry.models import (
    STATUS_READY,
    VISIBILITY_PUBLIC,
    VISIBILITY_SHARED,
    Adapter,
    AdapterShare,
    AdapterVersion,
)
from loraplex.platform.registry.names import AdapterRef


def usable_by(tenant_id: str):
    """SQL condition: adapters the tenant may list and call."""
    own_name = select(Tenant.name).where(Tenant.id == tenant_id).scalar_subquery()
    shared = exists().where(and_(AdapterShare.adapter_id == Adapter.id, AdapterShare.tenant_name == own_name))
    return or_(
        Adapter.tenant_id == tenant_id,
        Adapter.visibility == VISIBILITY_PUBLIC,
        and_(Adapter.visibility == VISIBILITY_SHARED, shared),
    )


@dataclass(frozen=True)
class Lookup:
    """A ready adapter version a caller may use (what the resolver turns into a LoRARequest)."""

    adapter_id: str
    owner: str  # tenant name
    name: str
    version: int
    version_id: int  # the engine's lora_int_id
    digest: str
    created: int  # unix seconds of the version

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def _ready():
    return and_(AdapterVersion.status == STATUS_READY, AdapterVersion.deleted_at.is_(None))


async def lookup(session: AsyncSession, principal: Principal, ref: AdapterRef) -> Lookup | None:
    owner_cond = Tenant.id == principal.tenant_id if ref.tenant is None else Tenant.name == ref.tenant
    row = (await session.execute(
        select(Adapter, Tenant.name).join(Tenant, Tenant.id == Adapter.tenant_id)
        .where(owner_cond, Adapter.name == ref.name, Adapter.deleted_at.is_(None), usable_by(principal.tenant_id))
    )).first()
    if row is None:
        return None
    adapter, owner = row
    stmt = select(AdapterVersion).where(AdapterVersion.adapter_id == adapter.id, _ready())
    if ref.version is not None:
        stmt = stmt.where(AdapterVersion.version == ref.version)
    version = (await session.execute(stmt.order_by(AdapterVersion.version.desc()).limit(1))).scalars().first()
    if version is None or version.digest is None:
        return None
    return Lookup(adapter_id=adapter.id, owner=owner, name=adapter.name, version=version.version,
                  version_id=version.id, digest=version.digest,
                  created=timestamp(version.ready_at or version.created_at))


@dataclass
class Listed:
    adapter: Adapter
    owner: str
    versions: list[AdapterVersion]  # newest first; for non-owners only ready ones
    shared_with: list[str] | None  # tenant names as the owner sent them (existing or not); only for the owner

    @property
    def latest_ready(self) -> AdapterVersion | None:
        return next((v for v in self.versions if v.status == STATUS_READY), None)


async def _versions(session: AsyncSession, adapter_ids: list[str], ready_only: bool) -> dict[str, list]:
    if not adapter_ids:
        return {}
    stmt = select(AdapterVersion).where(AdapterVersion.adapter_id.in_(adapter_ids),
                                        AdapterVersion.deleted_at.is_(None))
    if ready_only:
        stmt = stmt.where(AdapterVersion.status == STATUS_READY)
    out: dict[str, list] = {a: [] for a in adapter_ids}
    for v in (await session.execute(stmt.order_by(AdapterVersion.version.desc()))).scalars():
        out[v.adapter_id].append(v)
    return out


async def _shares(session: AsyncSession, adapter_ids: list[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {a: [] for a in adapter_ids}
    if adapter_ids:
        rows = await session.execute(select(AdapterShare.adapter_id, AdapterShare.tenant_name)
                                     .where(AdapterShare.adapter_id.in_(adapter_ids)))
        for adapter_id, name in rows:
            out[adapter_id].append(name)
    return {a: sorted(n) for a, n in out.items()}


async def list_usable(session: AsyncSession, principal: Principal, limit: int = 1000) -> list[Listed]:
    """The caller's adapters (every live version), then others' shared/public ones with a ready version."""
    rows = (await session.execute(
        select(Adapter, Tenant.name).join(Tenant, Tenant.id == Adapter.tenant_id)
        .where(Adapter.deleted_at.is_(None), usable_by(principal.tenant_id))
        .order_by(Adapter.tenant_id != principal.tenant_id, Tenant.name, Adapter.name).limit(limit)
    )).all()
    own = [a.id for a, _ in rows if a.tenant_id == principal.tenant_id]
    others = [a.id for a, _ in rows if a.tenant_id != principal.tenant_id]
    versions = {**await _versions(session, own, False), **await _versions(session, others, True)}
    shares = await _shares(session, own)
    out = []
    for adapter, owner in rows:
        mine = adapter.tenant_id == principal.tenant_id
        if not mine and not versions[adapter.id]:
            continue
        out.append(Listed(adapter, owner, versions[adapter.id], shares.get(adapter.id) if mine else None))
    return out


async def get_own(session: AsyncSession, tenant_id: str, name: str) -> Listed | None:
    adapter = await find_own(session, tenant_id, name)
    if adapter is None:
        return None
    owner = (await session.execute(select(Tenant.name).where(Tenant.id == tenant_id))).scalar_one()
    versions = await _versions(session, [adapter.id], False)
    shares = await _shares(session, [adapter.id])
    return Listed(adapter, owner, versions[adapter.id], shares[adapter.id])


async def find_own(session: AsyncSession, tenant_id: str, name: str, *, include_deleted: bool = False,
                   for_update: bool = False) -> Adapter | None:
    stmt = select(Adapter).where(Adapter.tenant_id == tenant_id, Adapter.name == name)
    if not include_deleted:
        stmt = stmt.where(Adapter.deleted_at.is_(None))
    if for_update:
        stmt = stmt.with_for_update()
    return (await session.execute(stmt)).scalars().first()


async def next_version(session: AsyncSession, adapter_id: str) -> int:
    current = (await session.execute(
        select(func.max(AdapterVersion.version)).where(AdapterVersion.adapter_id == adapter_id))).scalar()
    return (current or 0) + 1


def timestamp(value: datetime | None) -> int:
    return int(as_utc(value).timestamp()) if value is not None else 0
