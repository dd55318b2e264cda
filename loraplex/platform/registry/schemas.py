"""Wire types of ``/v1/adapters`` (msgspec; unknown body fields are ignored)."""

from __future__ import annotations

from datetime import datetime

import msgspec

from loraplex.platform.db import as_utc
from loraplex.platform.registry.models import STATUS_READY
from loraplex.platform.registry.queries import Listed


class VersionOut(msgspec.Struct):
    version: int
    model: str  # pins this version: "<name>@<version>"
    status: str  # uploading | validating | ready | failed
    error: str | None
    sha256: str | None  # content digest (identical uploads share it and are stored once)
    size_bytes: int | None
    rank: int | None
    target_modules: list[str] | None
    dtype: str | None
    created_at: datetime
    ready_at: datetime | None
    object: str = "adapter.version"


class AdapterOut(msgspec.Struct):
    id: str
    name: str
    model: str  # the value of ``model`` that calls this adapter (latest ready version)
    owner: str  # tenant name
    description: str | None
    visibility: str  # private | shared | public
    shared_with: list[str] | None  # tenant names; shown to the owner only
    status: str  # ready when a version is servable, else the newest version's status
    latest_version: int | None  # the version ``model`` resolves to
    versions: list[VersionOut]
    created_at: datetime
    updated_at: datetime
    version: int | None = None  # on upload: the version this upload created; on GET name@N: N
    object: str = "adapter"


class AdapterList(msgspec.Struct):
    data: list[AdapterOut]
    object: str = "list"


class AdapterPatch(msgspec.Struct):
    """Fields left out stay as they are; ``shared_with`` replaces the whole list."""

    description: str | None = None
    visibility: str | None = None
    shared_with: list[str] | None = None


class AdapterDeleted(msgspec.Struct):
    id: str
    deleted: bool = True
    object: str = "adapter"


def adapter_out(item: Listed, caller_tenant_id: str, version: int | None = None) -> AdapterOut:
    a = item.adapter
    own = a.tenant_id == caller_tenant_id
    model = a.name if own else f"{item.owner}/{a.name}"
    ready = item.latest_ready
    status = STATUS_READY if ready else (item.versions[0].status if item.versions else "deleted")
    return AdapterOut(
        id=a.id, name=a.name, model=model, owner=item.owner, description=a.description, visibility=a.visibility,
        shared_with=item.shared_with if own else None, status=status,
        latest_version=ready.version if ready else None,
        versions=[VersionOut(
            version=v.version, model=f"{model}@{v.version}", status=v.status, error=v.error, sha256=v.digest,
            size_bytes=v.size_bytes, rank=v.rank, target_modules=v.target_modules, dtype=v.dtype,
            created_at=as_utc(v.created_at), ready_at=as_utc(v.ready_at),
        ) for v in item.versions],
        created_at=as_utc(a.created_at), updated_at=as_utc(a.updated_at), version=version,
    )
