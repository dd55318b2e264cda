"""Test helper: an in-process app (SQLite or Postgres, optional tiny-model engine) with the usage area."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from pathlib import Path

from litestar.testing import AsyncTestClient

from loraplex.platform.app import create_app
from loraplex.settings import Settings


class AppAccess:
    """What a test reads of an in-process app (``self.app``) with its bootstrap admin key (``self.admin_key``)."""

    app: object
    admin_key: str

    @property
    def services(self):
        return self.app.state.services

    @property
    def usage(self):
        return self.services.extras["usage"]

    def headers(self, key: str | None = None) -> dict:
        return {"Authorization": f"Bearer {key or self.admin_key}"}


@dataclass
class UsageApp(AppAccess):
    client: AsyncTestClient
    admin_key: str
    data_dir: Path
    app: object

    async def tenant(self, name: str, scopes=("inference",)) -> dict:
        r = await self.client.post("/admin/tenants", json={"name": name}, headers=self.headers())
        assert r.status_code == 201, r.text
        tenant = r.json()
        r = await self.client.post("/admin/keys", json={"tenant": name, "scopes": list(scopes)},
                                   headers=self.headers())
        assert r.status_code == 201, r.text
        return {"id": tenant["id"], "name": name, "key": r.json()["key"], "key_id": r.json()["id"]}

    async def wait_ready(self, timeout_s: float = 120.0) -> None:
        for _ in range(int(timeout_s * 10)):
            if (await self.client.get("/ready")).status_code == 200:
                return
            await asyncio.sleep(0.1)
        raise TimeoutError("engine not ready")


@contextlib.asynccontextmanager
async def usage_app(data_dir: Path, *, model: str | None = None, database_url: str | None = None, **settings):
    """``model=None``: no engine (routes that do not infer)."""
    keys: list[str] = []
    s = Settings(data_dir=str(data_dir), model=model, database_url=database_url, device="cpu",
                 log_level="WARNING", **settings)
    app = create_app(s, start_engine=model is not None, run_migrations=True, on_bootstrap_key=keys.append)
    async with AsyncTestClient(app=app, timeout=60) as client:
        ua = UsageApp(client, keys[0] if keys else "", Path(data_dir), app)
        if model is not None:
            await ua.wait_ready()
        yield ua
