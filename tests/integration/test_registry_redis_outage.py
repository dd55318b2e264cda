"""A registry change that takes access away (delete, unsharing) while this replica cannot reach Redis.

Lookups are cached in Redis under a generation stamp that every change renews. A change committed while the
stamp could not be renewed left the old cached lookups in Redis: once Redis answered again, every replica
kept resolving a deleted (or unshared) adapter for up to the cache TTL (60 s), although the delete had
answered 200. Such a change now fails closed, as docs/api.md promises for everything that needs an
invalidation: 503 ``service_unavailable`` + ``Retry-After`` and nothing changed; a retry once Redis is back
takes effect on every replica at once.
"""

from __future__ import annotations

import contextlib

import pytest

from loraplex.platform.migrate import upgrade_async
from tests.integration.tcp_proxy import TcpProxy
from tests.integration.test_registry_replicas import _replica
from tests.unit.registry.conftest import adapter_files


@pytest.fixture
def pg_url(postgres_url):
    from tests.e2e.server import FreshPostgres

    with FreshPostgres(postgres_url) as url:
        yield url


@contextlib.asynccontextmanager
async def _replicas(tmp_path, tiny_model, pg_url, redis_url):
    """(proxy, a, b): two replicas on one database, A reaching Redis through ``proxy`` (which the test cuts), B
    directly; one admin key for both."""
    await upgrade_async(pg_url)
    proxy = TcpProxy.to_redis(redis_url)
    keys: list[str] = []
    model_dir = tiny_model["model_dir"]
    try:
        async with _replica(tmp_path, model_dir, pg_url, proxy.redis_url, keys=keys) as a, \
                _replica(tmp_path, model_dir, pg_url, redis_url, keys=keys) as b:
            b.admin_key = a.admin_key
            yield proxy, a, b
    finally:
        proxy.close()


async def _resolves(replica, key: str, model: str) -> bool:
    r = await replica.client.get(f"/v1/models/{model}", headers=replica.headers(key))
    assert r.status_code in (200, 404), r.text
    return r.status_code == 200


@pytest.mark.parametrize("change", ["delete", "delete_version", "unshare"])
async def test_a_change_that_cannot_be_announced_is_refused(change, tmp_path, tiny_model, pg_url, redis_url):
    async with _replicas(tmp_path, tiny_model, pg_url, redis_url) as (proxy, a, b):
        owner, other = await a.tenant("acme"), await a.tenant("beta")
        config, weights = adapter_files(tiny_model, 2)
        r = await a.upload(owner, "bot", config=config, weights=weights, shared_with="beta")
        assert r.status_code == 201, r.text
        user, model = (other, "acme/bot") if change == "unshare" else (owner, "bot")
        assert await _resolves(a, user, model) and await _resolves(b, user, model)  # both cache the hit

        def send():
            if change == "unshare":
                return a.client.patch("/v1/adapters/bot", json={"shared_with": []}, headers=a.headers(owner))
            return a.client.delete("/v1/adapters/bot" + ("@1" if change == "delete_version" else ""),
                                   headers=a.headers(owner))

        proxy.cut()
        r = await send()
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "service_unavailable" and r.headers["retry-after"]
        proxy.restore()
        # nothing changed: the owner still has it, the other tenant may still use it
        got = await b.client.get("/v1/adapters/bot", headers=b.headers(owner))
        assert got.status_code == 200 and got.json()["shared_with"] == ["beta"]
        assert await _resolves(b, user, model)

        r = await send()  # the retry, with Redis back: effective on both replicas at once
        assert r.status_code == 200, r.text
        assert not await _resolves(b, user, model)
        assert not await _resolves(a, user, model)


@pytest.mark.parametrize("upload", ["new_name", "new_version"])
async def test_an_upload_that_cannot_be_announced_is_refused(upload, tmp_path, tiny_model, pg_url, redis_url):
    """An upload committed while the stamp could not be renewed left another replica's cached "not found"
    (or its cached older version) in Redis for up to 60 s once Redis answered again."""
    async with _replicas(tmp_path, tiny_model, pg_url, redis_url) as (proxy, a, b):
        owner = await a.tenant("acme")
        first, second = adapter_files(tiny_model, 0), adapter_files(tiny_model, 1)
        if upload == "new_version":
            r = await a.upload(owner, "bot", config=first[0], weights=first[1])
            assert r.status_code == 201, r.text
        # replica B caches its lookup: a miss, or version 1
        assert await _resolves(b, owner, "bot") == (upload == "new_version")
        digests = a.store_digests()

        proxy.cut()
        r = await a.upload(owner, "bot", config=second[0], weights=second[1])
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "service_unavailable" and r.headers["retry-after"]
        proxy.restore()
        # nothing stored: no new version (not even a failed one), no new content in the store
        got = await b.client.get("/v1/adapters/bot", headers=b.headers(owner))
        if upload == "new_name":
            assert got.status_code == 404, got.text
        else:
            assert [v["version"] for v in got.json()["versions"]] == [1], got.text
        assert a.store_digests() == digests

        r = await a.upload(owner, "bot", config=second[0], weights=second[1])  # the retry, Redis back
        assert r.status_code == 201, r.text
        version = r.json()["version"]
        got = await b.client.get("/v1/models/bot", headers=b.headers(owner))  # B sees it at once
        assert got.status_code == 200, got.text
        r = await b.client.get("/v1/adapters/bot", headers=b.headers(owner))
        assert r.json()["latest_version"] == version == (2 if upload == "new_version" else 1)
