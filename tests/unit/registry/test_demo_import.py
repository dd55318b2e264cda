"""Embedded first run: the demo adapters generated with the demo model become public adapters of the admin
tenant, listed in /v1/models for every tenant, and a restart does not import them twice."""

from __future__ import annotations

import asyncio

from litestar.testing import AsyncTestClient

from loraplex.platform.app import create_app
from loraplex.platform.engine_boot import ensure_model
from loraplex.settings import Settings


async def _wait_imported(app, n: int) -> None:
    # the app runs on the test client's own loop: poll the task rather than await it
    task = app.state.services.extras["registry_demo_import"]
    for _ in range(600):
        if task.done():
            break
        await asyncio.sleep(0.05)
    assert task.done() and task.result() == n


async def test_demo_adapters_are_imported_once(tmp_path):
    settings = Settings(data_dir=str(tmp_path / "data"), device="cpu")  # no model: the embedded demo
    demo_dir = ensure_model(settings)  # what the engine start does on first run
    demo_names = sorted(p.name for p in (demo_dir / "adapters").iterdir())
    assert demo_names
    keys: list[str] = []
    app = create_app(settings, start_engine=False, on_bootstrap_key=keys.append)
    async with AsyncTestClient(app) as client:
        await _wait_imported(app, len(demo_names))
        admin = {"Authorization": f"Bearer {keys[0]}"}
        r = await client.post("/admin/tenants", json={"name": "guest"}, headers=admin)
        r = await client.post("/admin/keys", json={"tenant": "guest"}, headers=admin)
        guest = {"Authorization": f"Bearer {r.json()['key']}"}
        models = {m["id"] for m in (await client.get("/v1/models", headers=guest)).json()["data"]}
        assert models == {"demo-model"} | {f"admin/{n}" for n in demo_names}
        listed = (await client.get("/v1/adapters", headers=admin)).json()["data"]
        assert {a["name"] for a in listed} == set(demo_names)
        assert all(a["visibility"] == "public" and a["status"] == "ready" for a in listed)
    app = create_app(settings, start_engine=False)
    async with AsyncTestClient(app):
        await _wait_imported(app, 0)  # already there: nothing imported again
