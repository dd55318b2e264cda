"""The service container every handler reaches through ``request.app.state.services``."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy.ext.asyncio import AsyncEngine

from loraplex.engine.protocol import EngineClient
from loraplex.platform.auth import Authenticator
from loraplex.platform.db import SessionFactory
from loraplex.platform.hooks import ModelResolver, NoQuota, QuotaGate, UsageSink
from loraplex.platform.inference.tokenizer_queue import TokenizerQueue
from loraplex.platform.kv import KV
from loraplex.platform.limits import Admission, RateLimiter
from loraplex.platform.metrics import Metrics
from loraplex.settings import Settings

log = logging.getLogger(__name__)


@dataclass
class Services:
    settings: Settings
    db: AsyncEngine
    sessions: SessionFactory  # the one session factory: ``async with services.sessions() as s``
    kv: KV
    metrics: Metrics
    authenticator: Authenticator
    limiter: RateLimiter
    admission: Admission
    models: ModelResolver  # replaced by the registry's resolver in its setup()
    usage: UsageSink  # replaced by the usage ledger in its setup()
    server_secret: bytes
    base_model_id: str  # public id of the base model (what ``model`` names for no adapter)
    engine: EngineClient | None = None  # None while loading
    engine_error: str | None = None  # why the engine could not start
    engine_restarts: int = 0  # engines replaced by the supervisor after their loop died
    freeze_gc: bool = False  # loraplex serve: freeze the heap once the engine has loaded (engine/gc_heap.py)
    draining: bool = False
    # set once ``drain_timeout_s`` has passed after the exit signal: generations still running end with a 503
    # ``draining`` (an error event in a stream) instead of being cut by the HTTP server's own timeout
    drain_expired: bool = False
    extras: dict[str, object] = field(default_factory=dict)  # per-area state (e.g. "registry")
    background: set[asyncio.Task] = field(default_factory=set)
    # the one thread that runs the HTTP side's tokenizer, tenants served in turn (inference/tokenizer_queue.py)
    tokenizer: TokenizerQueue = field(default_factory=TokenizerQueue)
    quota: QuotaGate = field(default_factory=NoQuota)  # replaced by the usage area's quota tracker

    def spawn(self, coro, name: str | None = None) -> asyncio.Task:
        """Run ``coro`` on its own task (kept until done; awaited at shutdown). For work that must
        finish even when the request's task is cancelled (aborts, usage records)."""
        task = asyncio.create_task(coro, name=name)
        self.background.add(task)
        task.add_done_callback(self.background.discard)
        return task

    async def wait_background(self, timeout_s: float = 10.0) -> None:
        if self.background:
            await asyncio.wait(list(self.background), timeout=timeout_s)

    def cache_salt(self, tenant_id: str) -> str:
        """Per-tenant prefix-cache salt; never from the client (tenants never share cached KV)."""
        return hmac.new(self.server_secret, b"prefix-cache:" + tenant_id.encode(), hashlib.sha256).hexdigest()

    @property
    def engine_ready(self) -> bool:
        return self.engine is not None and self.engine.is_healthy()


def load_server_secret(settings: Settings) -> bytes:
    """``LORAPLEX_SERVER_SECRET``, else a random secret kept in ``data_dir/server_secret`` (mode 0600).

    Replicas must share it (set the env var) so a tenant's cache salt is the same everywhere.
    """
    if settings.server_secret:
        return settings.server_secret.encode()
    path = Path(settings.data_path) / "server_secret"
    if path.is_file():
        return path.read_text().strip().encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    value = secrets.token_hex(32)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another process won the race
        return path.read_text().strip().encode()
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    log.info("generated a server secret in %s", path)
    return value.encode()
