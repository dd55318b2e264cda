"""Start-up wiring: the store, the registry service, its ModelResolver, the eviction listener, and the
embedded default's demo adapters (imported as public adapters of the admin tenant on first run)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

from litestar import Request

from loraplex.platform.auth import Principal
from loraplex.platform.errors import ApiError
from loraplex.platform.models import SCOPE_ADMIN
from loraplex.platform.registry import cleanup, queries
from loraplex.platform.registry.events import EngineEvictor
from loraplex.platform.registry.models import VISIBILITY_PUBLIC
from loraplex.platform.registry.resolver import RegistryModelResolver
from loraplex.platform.registry.service import Metadata, Registry, load_base_config
from loraplex.platform.registry.store import LocalStore
from loraplex.platform.tenants import ADMIN_TENANT, get_tenant

log = logging.getLogger(__name__)

STORE_SUBDIR = "adapters"  # under data_dir: store/ (content) and tmp/ (uploads in progress)
DEMO_POLL_S = 0.5


def base_model_dir(settings) -> Path:
    if settings.model:
        return Path(settings.model)
    from loraplex.platform.engine_boot import demo_model_dir

    return demo_model_dir(settings)


class _BaseConfig:
    """The served base model's config.json, read once it exists (the demo model is generated at start)."""

    def __init__(self, model_dir: Path):
        self.model_dir, self._config = model_dir, None

    def __call__(self) -> dict | None:
        if self._config is None:
            self._config = load_base_config(self.model_dir)
        return self._config


def registry_of(request: Request) -> Registry:
    registry = request.app.state.services.extras.get("registry")
    if registry is None:
        raise ApiError(503, "The adapter registry is not running.", type="server_error", code="unavailable")
    return registry


async def setup(services) -> None:
    settings = services.settings
    root = settings.data_path / STORE_SUBDIR
    store = LocalStore(root / "store")
    registry = Registry(services.sessions, services.kv, store, tmp_root=root / "tmp",
                        base_config=_BaseConfig(base_model_dir(settings)),
                        max_upload_bytes=settings.max_upload_bytes, max_lora_rank=settings.max_lora_rank)
    services.extras["registry_cleanup"] = asyncio.create_task(
        cleanup.run_periodically(services.sessions, store, registry.tmp_root), name="registry-cleanup")
    services.models = RegistryModelResolver(services.sessions, services.kv, store, base=services.models,
                                            base_model_id=services.base_model_id)
    evictor = EngineEvictor(services)
    await evictor.start()
    services.extras.update(registry=registry, registry_evictor=evictor)
    if not settings.model:
        services.extras["registry_demo_import"] = asyncio.create_task(
            import_demo_adapters(services, registry), name="registry-demo-import")


async def teardown(services) -> None:
    for name in ("registry_demo_import", "registry_cleanup"):
        task = services.extras.pop(name, None)
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    evictor = services.extras.pop("registry_evictor", None)
    if evictor is not None:
        await evictor.stop()


async def import_demo_adapters(services, registry: Registry) -> int:
    """Once the demo model exists, register its adapters as public adapters of the admin tenant (callable
    by every tenant as ``admin/<name>``). Idempotent: a name the admin tenant has (or deleted) is skipped."""
    adapters_dir = base_model_dir(services.settings) / "adapters"
    while registry.base_config() is None or not (adapters_dir.parent / "loraplex_demo.json").is_file():
        if services.engine_error:
            return 0
        await asyncio.sleep(DEMO_POLL_S)
    async with services.sessions() as session:
        tenant = await get_tenant(session, ADMIN_TENANT)
    admin = Principal(tenant_id=tenant.id, tenant_name=tenant.name, key_id="system", scopes=frozenset({SCOPE_ADMIN}))
    imported = 0
    for directory in sorted(p for p in adapters_dir.iterdir() if p.is_dir()):
        async with services.sessions() as session:
            if await queries.find_own(session, tenant.id, directory.name, include_deleted=True) is not None:
                continue
        try:
            await registry.import_directory(admin, directory.name, directory, Metadata(
                description="demo adapter generated with the demo model", visibility=VISIBILITY_PUBLIC))
            imported += 1
        except Exception:
            log.exception("could not import demo adapter %s", directory.name)
    if imported:
        log.info("imported %d demo adapters as public adapters admin/<name>", imported)
    return imported
