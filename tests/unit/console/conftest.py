"""Console test helpers: the real app in-process (SQLite, registry and usage areas), browser-like sign-in."""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest
from litestar.testing import AsyncTestClient

from loraplex.platform.app import create_app
from loraplex.settings import Settings

CSRF_META = re.compile(r'<meta name="csrf-token" content="([^"]*)"')
CSRF_FIELD = re.compile(r'name="_csrf" value="([^"]+)"')


@dataclass
class ConsoleApp:
    app: object
    admin_key: str
    c: AsyncTestClient  # the browser; ``c.cookies.clear()`` starts a fresh one

    @property
    def services(self):
        return self.app.state.services

    async def tenant(self, name: str, scopes=("inference", "adapters:write")) -> tuple[str, str]:
        """(key, key id) of a new tenant, made through the admin API (no cookies involved)."""
        h = {"Authorization": f"Bearer {self.admin_key}"}
        r = await self.c.post("/admin/tenants", json={"name": name}, headers=h)
        assert r.status_code == 201, r.text
        r = await self.c.post("/admin/keys", json={"tenant": name, "scopes": list(scopes)}, headers=h)
        assert r.status_code == 201, r.text
        return r.json()["key"], r.json()["id"]


async def sign_in(client: AsyncTestClient, key: str):
    """Sign in like a browser: open the form (pre-session cookie + token), post it. Returns the response."""
    r = await client.get("/console/login")
    token = CSRF_FIELD.search(r.text).group(1)
    return await client.post("/console/login", data={"_csrf": token, "api_key": key, "next": "/console"},
                             follow_redirects=False)


async def csrf_of(client: AsyncTestClient, path: str = "/console/keys") -> str:
    r = await client.get(path)
    assert r.status_code == 200, r.text
    return CSRF_META.search(r.text).group(1)


@pytest.fixture
async def capp(tmp_path, tiny_model):
    keys: list[str] = []
    settings = Settings(data_dir=str(tmp_path / "data"), model=tiny_model["model_dir"], device="cpu")
    app = create_app(settings, start_engine=False, on_bootstrap_key=keys.append)
    async with AsyncTestClient(app, timeout=30) as client:
        yield ConsoleApp(app, keys[0], client)
