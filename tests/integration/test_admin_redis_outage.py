"""Admin changes that must reach every replica's auth cache (revoke a key, suspend a tenant, change its
limits) while Redis is unreachable: 503 ``service_unavailable`` and nothing changed, like the ``loraplex
admin`` CLI. They used to commit first and then fail to publish: the operator read "503, retry shortly"
for a change that had in fact been made (and had reached no other replica's cache)."""

from __future__ import annotations

import pytest
from litestar.testing import AsyncTestClient

from loraplex.platform.app import create_app
from loraplex.settings import Settings
from tests.integration.tcp_proxy import TcpProxy


@pytest.mark.parametrize("change", ["revoke", "suspend", "limits"])
async def test_admin_change_without_redis_changes_nothing(change, tmp_path, redis_url):
    proxy = TcpProxy.to_redis(redis_url)
    keys: list[str] = []
    app = create_app(Settings(data_dir=str(tmp_path), redis_url=proxy.redis_url), start_engine=False,
                     on_bootstrap_key=keys.append)
    try:
        async with AsyncTestClient(app, timeout=30) as client:
            admin = {"Authorization": f"Bearer {keys[0]}"}
            # a per-test tenant name: the buckets and caches live in the shared Redis
            name = f"t{tmp_path.name[-20:].replace('_', '-').lower()}"
            assert (await client.post("/admin/tenants", json={"name": name}, headers=admin)).status_code == 201
            key_id = (await client.post("/admin/keys", json={"tenant": name}, headers=admin)).json()["id"]

            def send():
                if change == "revoke":
                    return client.delete(f"/admin/keys/{key_id}", headers=admin)
                if change == "suspend":
                    return client.post(f"/admin/tenants/{name}/suspend", headers=admin)
                return client.put(f"/admin/tenants/{name}/limits", json={"requests_per_minute": 7},
                                  headers=admin)

            async def state():
                tenant = (await client.get(f"/admin/tenants/{name}", headers=admin)).json()
                listed = (await client.get("/admin/keys", params={"tenant": name}, headers=admin)).json()["data"]
                return tenant["status"], tenant["requests_per_minute"], listed[0]["revoked_at"]

            assert await state() == ("active", None, None)
            proxy.cut()
            r = await send()
            assert r.status_code == 503 and r.json()["error"]["code"] == "service_unavailable", r.text
            proxy.restore()
            assert await state() == ("active", None, None)  # nothing changed behind the 503
            assert (await send()).status_code == 200
            changed = await state()
            assert changed != ("active", None, None)
    finally:
        proxy.close()
