"""The Litestar application: ``create_app(settings, engine_client=None)``.

Areas plug in by listing a module in :data:`ROUTE_MODULES`. Such a module exposes
``route_handlers() -> list`` and may expose ``async setup(services)`` (run at startup, after the core
services exist: install a ``ModelResolver``/``UsageSink``, start background tasks) and
``async teardown(services)``. A module that does not exist yet is skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
from collections.abc import AsyncIterator, Callable
from types import ModuleType

from litestar import Litestar
from litestar.openapi import OpenAPIConfig
from litestar.openapi.plugins import SwaggerRenderPlugin

from loraplex import __version__
from loraplex.engine.config import served_model_id as engine_served_model_id
from loraplex.engine.protocol import EngineClient
from loraplex.platform import migrate
from loraplex.platform.auth import AUTH_CACHE_TTL_EMBEDDED_S, AUTH_CACHE_TTL_REDIS_S, Authenticator
from loraplex.platform.db import is_sqlite, make_engine, make_session_factory
from loraplex.platform.deployment import record_redis_url
from loraplex.platform.errors import exception_handlers
from loraplex.platform.hooks import BaseModelResolver, LoggingUsageSink
from loraplex.platform.json_body import JsonBodyRequest
from loraplex.platform.kv import make_kv
from loraplex.platform.limits import Admission, RateLimiter
from loraplex.platform.metrics import Metrics
from loraplex.platform.middleware import platform_middleware
from loraplex.platform.services import Services, load_server_secret
from loraplex.platform.tenants import bootstrap_admin
from loraplex.settings import Settings

log = logging.getLogger(__name__)

CORE_ROUTE_MODULES = (
    "loraplex.platform.system_routes",  # /health /ready /metrics
    "loraplex.platform.admin_routes",  # /admin/tenants /admin/keys
    "loraplex.platform.inference.routes",  # /v1/models /v1/completions /v1/chat/completions
)
ROUTE_MODULES = (
    "loraplex.platform.registry.routes",  # /v1/adapters, admin adapter routes
    "loraplex.platform.usage.routes",  # usage queries and billing exports
    "loraplex.platform.console.routes",  # /console
)
DEMO_MODEL_DIR = "demo-model"  # under data_dir


def served_model_id(settings: Settings) -> str:
    """The base model's public id: the model directory's name (``demo-model`` for the demo)."""
    return engine_served_model_id(settings.model) if settings.model else DEMO_MODEL_DIR


def load_modules(paths: tuple[str, ...]) -> list[ModuleType]:
    modules = []
    for path in paths:
        try:
            modules.append(importlib.import_module(path))
        except ModuleNotFoundError as exc:
            # only "this area is not built yet"; a broken import inside an area is a real error
            if exc.name and path.startswith(exc.name):
                log.debug("route module %s not present; skipped", path)
                continue
            raise
    return modules


def create_app(
    settings: Settings,
    engine_client: EngineClient | None = None,
    *,
    start_engine: bool = True,
    run_migrations: bool = True,
    on_bootstrap_key: Callable[[str], None] | None = None,
    freeze_gc: bool = False,
) -> Litestar:
    """Build the app. Without ``engine_client`` the engine is started from ``settings`` in the
    background (``/ready`` is 503 until it runs); ``start_engine=False`` serves without one.
    ``run_migrations``: upgrade the database at start (a Postgres advisory lock serialises replicas).
    A bootstrap admin key created on first start is handed to ``on_bootstrap_key`` (shown once).
    ``freeze_gc``: once the engine has loaded, freeze the process's heap (``loraplex serve`` only: the process
    exists for the server; ``loraplex.engine.gc_heap``).
    A secret setting left at a deploy file's placeholder is a ConfigError here, before anything starts."""
    settings.check_secrets()
    modules = load_modules(CORE_ROUTE_MODULES) + load_modules(ROUTE_MODULES)
    handlers = [h for m in modules for h in m.route_handlers()]
    url = settings.effective_database_url
    base_model_id = engine_client.model_id if engine_client else served_model_id(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        if is_sqlite(url):
            settings.data_path.mkdir(parents=True, exist_ok=True)
        if run_migrations:
            await migrate.upgrade_async(url, settings=settings)
        db = make_engine(url, settings)
        kv = make_kv(settings.effective_redis_url)
        sessions = make_session_factory(db)
        ttl = AUTH_CACHE_TTL_REDIS_S if settings.redis_url else AUTH_CACHE_TTL_EMBEDDED_S
        services = Services(
            settings=settings, db=db, sessions=sessions, kv=kv, metrics=Metrics(),
            authenticator=Authenticator(sessions, kv, cache_ttl_s=ttl),
            limiter=RateLimiter(kv, settings), admission=Admission(settings.max_concurrent_requests),
            models=BaseModelResolver(base_model_id), base_model_id=base_model_id,
            usage=LoggingUsageSink(), server_secret=load_server_secret(settings), engine=engine_client,
            freeze_gc=freeze_gc,
        )
        services.metrics.attach_engine(
            lambda: base_model_id,
            lambda: services.engine.stats() if services.engine else None,
            settings.max_loras,
        )
        services.metrics.attach_admission(lambda: services.admission.in_flight, settings.max_concurrent_requests)
        app.state.services = services
        await services.authenticator.start()
        async with sessions() as session:
            key = await bootstrap_admin(session)
        await record_redis_url(sessions, settings.effective_redis_url)  # for the CLI's invalidations (deployment.py)
        if key and on_bootstrap_key is not None:
            on_bootstrap_key(key)
        engine_task = None
        if engine_client is None and start_engine:
            from loraplex.platform.engine_boot import start_engine_in_background

            engine_task = asyncio.create_task(start_engine_in_background(services), name="engine-start")
        for module in modules:
            setup = getattr(module, "setup", None)
            if setup is not None:
                await setup(services)
        try:
            yield
        finally:
            # usage records of the last requests land before the areas tear down
            await services.wait_background()
            for module in reversed(modules):
                teardown = getattr(module, "teardown", None)
                if teardown is not None:
                    try:
                        await teardown(services)
                    except Exception:
                        log.exception("teardown of %s failed", module.__name__)
            if engine_task is not None and not engine_task.done():
                engine_task.cancel()
            if services.engine is not None and engine_client is None:
                await services.engine.shutdown()
            services.tokenizer.shutdown()
            await services.authenticator.stop()
            await kv.close()
            await db.dispose()

    app = Litestar(
        route_handlers=handlers,
        lifespan=[lifespan],
        exception_handlers=exception_handlers(),
        request_class=JsonBodyRequest,  # a number out of range in a JSON body names its field
        openapi_config=OpenAPIConfig(
            title="Loraplex", version=__version__, path="/schema",
            description="Multi-tenant LoRA serving: OpenAI-compatible API, adapters, admin.",
            render_plugins=[SwaggerRenderPlugin()],
        ),
        debug=False,
        # the process's logging is set up once by the CLI (loraplex/log.py): one format for serve and
        # every other command, instead of Litestar's own (which printed uvicorn's module names)
        logging_config=None,
    )
    # outermost: request ids and drain refusal also apply to 404/405 from routing
    app.asgi_handler = platform_middleware(app.asgi_handler, access_log_enabled=settings.access_log)
    return app
