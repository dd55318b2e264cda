"""Write side of the registry: the upload lifecycle, edits and soft deletes.

Upload: everything the form alone decides (name, description, visibility, sharing, which files came) is
checked before any row exists, so such a refusal leaves nothing on record. Only then, with the body in, is the
version row created as ``validating``; it turns ``ready`` (content stored, metadata applied) or ``failed``
with the reason. Validation is the engine's own ``validate_adapter_dir`` against the served base model;
nothing reaches the store before it passes, and the temporary directory is removed whatever happens.
(``uploading`` is left on rows of servers that created the row when the first file began.)
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from litestar import Request
from sqlalchemy import delete, select, update
from sqlalchemy.exc import IntegrityError

from loraplex.adapters import AdapterError, validate_adapter_dir
from loraplex.platform.auth import Principal
from loraplex.platform.db import SessionFactory, new_id, utcnow
from loraplex.platform.errors import ApiError, bad_request, forbidden, not_found
from loraplex.platform.kv import KV
from loraplex.platform.registry import events, queries
from loraplex.platform.registry.archive import extract_adapter_archive
from loraplex.platform.registry.models import (
    STATUS_FAILED,
    STATUS_READY,
    STATUS_VALIDATING,
    VISIBILITIES,
    VISIBILITY_PRIVATE,
    VISIBILITY_PUBLIC,
    VISIBILITY_SHARED,
    Adapter,
    AdapterShare,
    AdapterVersion,
)
from loraplex.platform.registry.names import validate_adapter_name
from loraplex.platform.registry.store import AdapterStore, adapter_digest
from loraplex.platform.registry.upload import UploadForm, UploadSlots, check_files, receive_upload
from loraplex.platform.tenants import TENANT_NAME_RE

log = logging.getLogger(__name__)

MAX_DESCRIPTION = 1024
MAX_SHARES = 100
# C0 controls (NUL, escapes) but tab and newlines, and DEL: PostgreSQL refuses NUL, terminals obey escapes
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
VERSION_RETRIES = 8


@dataclass(frozen=True)
class Pending:
    adapter_id: str
    version_id: int
    version: int
    name: str


@dataclass(frozen=True)
class Metadata:
    """Checked upload/PATCH fields; None = leave unchanged."""

    description: str | None = None
    visibility: str | None = None
    shared_with: list[str] | None = None  # tenant names (existing or not: see AdapterShare)


def _error_text(exc: BaseException) -> str:
    return (exc.message if isinstance(exc, ApiError) else "interrupted before it finished")[:2000]


class Registry:
    def __init__(self, sessions: SessionFactory, kv: KV, store: AdapterStore, *, tmp_root: Path,
                 base_config, max_upload_bytes: int, max_lora_rank: int, idle_timeout_s: float = 60.0,
                 deadline_s: float = 900.0):
        self.sessions, self.kv, self.store = sessions, kv, store
        self.tmp_root = Path(tmp_root)
        self.tmp_root.mkdir(parents=True, exist_ok=True)
        self.base_config = base_config  # () -> the base model's config dict, or None while it is generated
        self.max_upload_bytes = max_upload_bytes
        self.max_lora_rank = max_lora_rank
        self.idle_timeout_s = idle_timeout_s
        self.deadline_s = deadline_s
        self.slots = UploadSlots()

    # ---- field checks ---------------------------------------------------------------------------
    async def check_metadata(self, principal: Principal, description: str | None, visibility: str | None,
                             shared_with: list[str] | None) -> Metadata:
        if description is not None and len(description) > MAX_DESCRIPTION:
            raise bad_request(f"description is longer than {MAX_DESCRIPTION} characters", param="description")
        if description is not None and _CONTROL.search(description):
            raise bad_request("description must not contain control characters (tab and newline are fine)",
                              param="description")
        if visibility is None and shared_with:
            visibility = VISIBILITY_SHARED
        elif visibility == VISIBILITY_PRIVATE and shared_with:  # accepted, it would look shared and share nothing
            raise bad_request("shared_with names tenants but visibility is 'private', which shares with no one: "
                              "send visibility 'shared' (or leave it out), or an empty shared_with",
                              param="shared_with")
        if visibility is not None and visibility not in VISIBILITIES:
            raise bad_request(f"visibility must be one of {', '.join(VISIBILITIES)}", param="visibility")
        if visibility == VISIBILITY_PUBLIC and not principal.is_admin:
            raise forbidden("Only admins can make an adapter public (use 'shared' with shared_with).",
                            param="visibility")
        names = None
        if shared_with is not None:
            # checked for spelling only: whether a named tenant exists is never revealed (SECURITY.md 2)
            names = sorted(set(shared_with) - {principal.tenant_name})
            if len(names) > MAX_SHARES:
                raise bad_request(f"shared_with lists more than {MAX_SHARES} tenants", param="shared_with")
            malformed = [n for n in names if not TENANT_NAME_RE.match(n)]
            if malformed:
                raise bad_request(f"shared_with: {', '.join(map(repr, malformed))[:300]} cannot be a tenant name "
                                  "(1-63 of a-z 0-9 - _, starting with a letter or digit)", param="shared_with")
        return Metadata(description, visibility, names)

    async def _form_metadata(self, principal: Principal, form: UploadForm) -> Metadata:
        return await self.check_metadata(principal, form.fields.get("description"), form.fields.get("visibility"),
                                         form.shared_with if form.shared_with else None)

    # ---- upload ---------------------------------------------------------------------------------
    async def upload(self, request: Request, principal: Principal) -> tuple[Pending, queries.Listed]:
        if self.base_config() is None:
            raise ApiError(503, "The base model is still being prepared; retry shortly.", type="server_error",
                           code="model_loading", headers={"Retry-After": "5"})
        # Redis unreachable: a 503 before anything is read or written (events.before_change)
        await events.before_change(self.kv)
        with self.slots.hold(principal.tenant_id):
            return await self._upload(request, principal)

    async def _upload(self, request: Request, principal: Principal) -> tuple[Pending, queries.Listed]:
        work = self.tmp_root / new_id()
        work.mkdir()
        pending: Pending | None = None

        async def on_first_file(form: UploadForm) -> None:
            if "name" in form.fields:  # refuse bad fields before the weights are read
                await self._form_metadata(principal, form)
                validate_adapter_name(form.fields["name"])

        try:
            form = await receive_upload(request, work, self.max_upload_bytes, self.idle_timeout_s, on_first_file,
                                        self.deadline_s)
            # the whole form, fields sent after the files included, before a row exists: refused here, the
            # upload leaves nothing on record (the name stays free, no version number is used up)
            meta = await self._form_metadata(principal, form)
            name = validate_adapter_name(form.fields.get("name"))
            check_files(form)
            pending = await self._begin(principal, name)
            adapter_dir = await asyncio.to_thread(self._assemble, form, work)
            await events.before_change(self.kv)  # again: Redis may have gone while the body came in
            return pending, await self._finish(principal, pending, adapter_dir, meta)
        except BaseException as exc:
            if pending is not None:
                await asyncio.shield(self._set_status(pending, STATUS_FAILED, error=_error_text(exc)))
                log.info("upload of %s@%d failed: %s", pending.name, pending.version, _error_text(exc))
            raise
        finally:
            await asyncio.to_thread(shutil.rmtree, work, True)

    async def _begin(self, principal: Principal, name: str) -> Pending:
        """The adapter row (created, or revived after a delete) and a new ``validating`` version (its content is
        in hand).

        Two uploads racing for a name both get a version: the loser of a unique-key race retries with the
        next number; after :data:`VERSION_RETRIES` lost races it answers 409."""
        for attempt in range(VERSION_RETRIES):
            async with self.sessions() as session:
                try:
                    adapter = await queries.find_own(session, principal.tenant_id, name, include_deleted=True)
                    if adapter is None:
                        adapter = Adapter(id=new_id(), tenant_id=principal.tenant_id, name=name,
                                          visibility=VISIBILITY_PRIVATE, created_at=utcnow(), updated_at=utcnow())
                        session.add(adapter)
                        await session.flush()
                    version = await queries.next_version(session, adapter.id)
                    row = AdapterVersion(adapter_id=adapter.id, version=version, status=STATUS_VALIDATING,
                                         created_at=utcnow())
                    session.add(row)
                    await session.commit()
                    return Pending(adapter.id, row.id, version, name)
                except IntegrityError:
                    await session.rollback()
            await asyncio.sleep(random.uniform(0.005, 0.05) * (attempt + 1))
        raise ApiError(409, f"Too many concurrent uploads of '{name}'; retry.", param="name", code="conflict")

    async def _set_status(self, pending: Pending, status: str, error: str | None = None) -> None:
        async with self.sessions() as session:
            await session.execute(update(AdapterVersion).where(AdapterVersion.id == pending.version_id)
                                  .values(status=status, error=error))
            await session.commit()

    async def import_directory(self, principal: Principal, name: str, adapter_dir: Path,
                               meta: Metadata) -> Pending:
        """Register an adapter directory on the server's disk (the demo adapters), through the same checks."""
        pending = await self._begin(principal, validate_adapter_name(name))
        try:
            await self._finish(principal, pending, Path(adapter_dir), meta)
        except BaseException as exc:
            await asyncio.shield(self._set_status(pending, STATUS_FAILED, error=_error_text(exc)))
            raise
        return pending

    async def _finish(self, principal: Principal, pending: Pending, adapter_dir: Path,
                      meta: Metadata) -> queries.Listed:
        try:
            spec = await asyncio.to_thread(
                validate_adapter_dir, adapter_dir, self.base_config(), self.max_lora_rank,
                max_file_bytes=self.max_upload_bytes)
        except AdapterError as exc:
            raise ApiError(422, f"adapter refused: {exc}", param=exc.field or _param_of(exc.file),
                           code="adapter_invalid") from None
        digest = await asyncio.to_thread(adapter_digest, adapter_dir)
        await asyncio.to_thread(self.store.put, adapter_dir, digest)
        async with self.sessions() as session:
            adapter = await session.get(Adapter, pending.adapter_id)
            if adapter.deleted_at is not None:  # deleted earlier: the upload revives the name
                adapter.deleted_at = None
                adapter.visibility, adapter.description = VISIBILITY_PRIVATE, None
                await session.execute(delete(AdapterShare).where(AdapterShare.adapter_id == adapter.id))
            await _apply(session, adapter, meta)
            await session.execute(update(AdapterVersion).where(AdapterVersion.id == pending.version_id).values(
                status=STATUS_READY, error=None, digest=digest, size_bytes=spec.num_bytes, rank=spec.rank,
                target_modules=list(spec.target_modules), dtype=spec.dtype, ready_at=utcnow()))
            await session.commit()
        if not await asyncio.to_thread(self.store.exists, digest):  # collected meanwhile (cleanup.py): again
            await asyncio.to_thread(self.store.put, adapter_dir, digest)
        await events.publish_ready(self.kv, pending.version_id, f"{principal.tenant_name}/{pending.name}")
        async with self.sessions() as session:
            listed = await queries.get_own(session, principal.tenant_id, pending.name)
        assert listed is not None
        return listed

    def _assemble(self, form: UploadForm, work: Path) -> Path:
        """The directory to validate: the archive's two files, or the two uploaded files (``check_files``
        passed)."""
        if "archive" in form.files:
            out = work / "adapter"
            out.mkdir()
            extract_adapter_archive(form.files["archive"], out, self.max_upload_bytes + (1 << 20))
            return out
        return work

    # ---- edits and deletes ----------------------------------------------------------------------
    async def update(self, principal: Principal, name: str, meta: Metadata) -> queries.Listed:
        await events.before_change(self.kv)
        async with self.sessions() as session:
            adapter = await queries.find_own(session, principal.tenant_id, name)
            if adapter is None:
                raise not_found(f"No adapter '{name}'.", param="name")
            await _apply(session, adapter, meta)
            await session.commit()
        await events.publish_changed(self.kv, f"{principal.tenant_name}/{name}")
        async with self.sessions() as session:
            listed = await queries.get_own(session, principal.tenant_id, name)
        assert listed is not None
        return listed

    async def delete(self, principal: Principal, name: str, version: int | None = None) -> list[int]:
        """Soft delete the adapter (every version) or one version; returns the evicted ``lora_int_id``s.

        Rows and stored content stay, so requests already running finish; new lookups miss at once."""
        await events.before_change(self.kv)
        now = utcnow()
        async with self.sessions() as session:
            adapter = await queries.find_own(session, principal.tenant_id, name)
            if adapter is None:
                raise not_found(f"No adapter '{name}'.", param="name")
            stmt = select(AdapterVersion.id).where(AdapterVersion.adapter_id == adapter.id,
                                                   AdapterVersion.deleted_at.is_(None))
            if version is not None:
                stmt = stmt.where(AdapterVersion.version == version)
            ids = list((await session.execute(stmt)).scalars())
            if version is not None and not ids:
                raise not_found(f"No version {version} of adapter '{name}'.", param="name")
            await session.execute(update(AdapterVersion).where(AdapterVersion.id.in_(ids)).values(deleted_at=now))
            remaining = (await session.execute(select(AdapterVersion.id).where(
                AdapterVersion.adapter_id == adapter.id, AdapterVersion.deleted_at.is_(None)).limit(1))).first()
            if version is None or remaining is None:  # deleting the last version deletes the adapter
                adapter.deleted_at = now
            adapter.updated_at = now
            await session.commit()
        label = f"{principal.tenant_name}/{name}" + (f"@{version}" if version else "")
        await events.publish_deleted(self.kv, ids, label)
        log.info("deleted adapter %s (versions %s)", label, ids)
        return ids


async def _apply(session, adapter: Adapter, meta: Metadata) -> None:
    if meta.description is not None:
        adapter.description = meta.description or None
    if meta.visibility is not None:
        adapter.visibility = meta.visibility
    if meta.shared_with is not None:
        # replaced wholesale: what the caller sent is the list
        await session.execute(delete(AdapterShare).where(AdapterShare.adapter_id == adapter.id))
        for tenant_name in meta.shared_with:
            session.add(AdapterShare(adapter_id=adapter.id, tenant_name=tenant_name))
    adapter.updated_at = utcnow()


def _param_of(file: str | None) -> str:
    return {"adapter_config.json": "config", "adapter_model.safetensors": "weights"}.get(file or "", "weights")


def load_base_config(model_dir: Path) -> dict | None:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    return json.loads(path.read_text())
