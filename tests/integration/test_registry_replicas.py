"""Two replicas on one PostgreSQL, one Redis and one shared adapter store: an adapter uploaded through one is
servable on the other at once (its cached miss is invalidated), a delete evicts it from the other's engine,
and concurrent uploads of one name through both replicas give distinct versions or a clear 409."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
from litestar.testing import AsyncTestClient

from loraplex.engine.async_engine import AsyncEngine
from loraplex.platform.app import create_app
from loraplex.platform.migrate import upgrade_async
from loraplex.settings import Settings
from tests.e2e.server import FreshPostgres
from tests.unit.registry.conftest import RegistryApp, adapter_files
from tests.unit.registry.test_serving import _engine_config

CHAT = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 3, "temperature": 0}


@pytest.fixture
def pg_url(postgres_url):
    with FreshPostgres(postgres_url) as url:
        yield url


@contextlib.asynccontextmanager
async def _replica(data_dir, model_dir, pg_url, redis_url, engine=None, keys=None):
    settings = Settings(data_dir=str(data_dir), model=model_dir, database_url=pg_url, redis_url=redis_url,
                        device="cpu", max_lora_rank=64)
    keys = keys if keys is not None else []
    app = create_app(settings, engine_client=engine, start_engine=False, on_bootstrap_key=keys.append)
    async with AsyncTestClient(app, timeout=60) as client:
        yield RegistryApp(client, keys[0] if keys else "", data_dir, app)


async def test_upload_on_one_replica_serves_and_deletes_on_another(tmp_path, tiny_model, pg_url, redis_url):
    await upgrade_async(pg_url)
    engine_b = AsyncEngine.from_config(_engine_config(tiny_model["model_dir"]))
    keys: list[str] = []
    try:
        async with _replica(tmp_path, tiny_model["model_dir"], pg_url, redis_url, keys=keys) as a, \
                _replica(tmp_path, tiny_model["model_dir"], pg_url, redis_url, engine=engine_b, keys=keys) as b:
            b.admin_key = a.admin_key
            key = await a.tenant("acme")
            r = await b.client.post("/v1/chat/completions", json={"model": "fresh", **CHAT}, headers=b.headers(key))
            assert r.status_code == 404  # and B has now cached that miss

            config, weights = adapter_files(tiny_model, 2)
            assert (await a.upload(key, "fresh", config=config, weights=weights)).status_code == 201
            t0 = time.monotonic()
            r = await b.client.post("/v1/chat/completions", json={"model": "fresh", **CHAT}, headers=b.headers(key))
            assert r.status_code == 200, r.text
            assert time.monotonic() - t0 < 1.0
            # (the apps' Postgres and Redis connections live on the test client's loop: ask the engine, which
            # has loaded exactly this one adapter version)
            manager = engine_b.engine.runner.lora_manager
            assert len(manager.host_cache.ids()) == 1
            lora_int_id = manager.host_cache.ids()[0]

            assert (await a.client.delete("/v1/adapters/fresh", headers=a.headers(key))).status_code == 200
            r = await b.client.post("/v1/chat/completions", json={"model": "fresh", **CHAT}, headers=b.headers(key))
            assert r.status_code == 404
            evictor = b.services.extras["registry_evictor"]
            deadline = time.monotonic() + 1.0
            while evictor.num_evicted == 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert evictor.num_evicted >= 1, "replica B never heard of the delete"
            # the engine drops the version once no running request holds it (at its next step)
            base = b.services.base_model_id
            r = await b.client.post("/v1/chat/completions", json={"model": base, **CHAT}, headers=b.headers(key))
            assert r.status_code == 200
            assert lora_int_id not in manager.host_cache

            uploads = [adapter_files(tiny_model, i % 2) for i in range(6)]
            results = await asyncio.gather(*[
                (a if i % 2 else b).upload(key, "race", config=c, weights=w) for i, (c, w) in enumerate(uploads)])
            assert {r.status_code for r in results} <= {201, 409}, [r.text[:200] for r in results]
            created = sorted(r.json()["version"] for r in results if r.status_code == 201)
            assert created and len(created) == len(set(created))
            got = (await a.client.get("/v1/adapters/race", headers=a.headers(key))).json()
            assert sorted(v["version"] for v in got["versions"]) == created
            assert all(v["status"] == "ready" for v in got["versions"])
            listed = (await b.client.get("/v1/adapters", headers=b.headers(key))).json()["data"]
            assert [a["model"] for a in listed] == ["race"]
            models = (await b.client.get("/v1/models", headers=b.headers(key))).json()["data"]
            assert [m["id"] for m in models] == [b.services.base_model_id, "race"]
    finally:
        await engine_b.shutdown()
