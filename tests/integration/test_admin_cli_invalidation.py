"""``loraplex admin key revoke`` / ``tenant suspend`` run with ``--database-url`` alone (no ``--redis-url``, no
LORAPLEX_REDIS_URL) still reach every replica on Redis within a second (SECURITY.md 5): the servers record their
Redis URL in the database and the CLI publishes there. Where it cannot, it still makes the change and says on
stderr how long servers keep the old state and what to pass. It used to print "revoked", exit 0, and leave the key
working on every replica for their auth cache's TTL (5 s)."""

from __future__ import annotations

import asyncio
import time

import pytest
from litestar.testing import AsyncTestClient

from loraplex.cli import main
from loraplex.platform.app import create_app
from loraplex.platform.migrate import upgrade_async
from loraplex.settings import Settings
from tests.e2e.server import FreshPostgres


@pytest.fixture
def pg_url(postgres_url, monkeypatch):
    for name in ("LORAPLEX_REDIS_URL", "LORAPLEX_DATABASE_URL"):
        monkeypatch.delenv(name, raising=False)
    with FreshPostgres(postgres_url) as url:
        yield url


async def cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = await asyncio.to_thread(main, list(argv))  # main runs its own event loop
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("change", ["revoke", "suspend"])
async def test_the_cli_without_redis_url_reaches_servers_on_redis_within_a_second(change, tmp_path, pg_url, redis_url,
                                                                                  capsys):
    keys: list[str] = []
    app = create_app(Settings(data_dir=str(tmp_path), database_url=pg_url, redis_url=redis_url), start_engine=False,
                     on_bootstrap_key=keys.append)
    async with AsyncTestClient(app, timeout=30) as client:
        admin = {"Authorization": f"Bearer {keys[0]}"}
        name = f"t{tmp_path.name[-20:].replace('_', '-').lower()}"
        assert (await client.post("/admin/tenants", json={"name": name}, headers=admin)).status_code == 201
        created = (await client.post("/admin/keys", json={"tenant": name}, headers=admin)).json()
        tenant_key = {"Authorization": f"Bearer {created['key']}"}
        assert (await client.get("/v1/models", headers=tenant_key)).status_code == 200  # now in the auth cache

        argv = ["admin", "key", "revoke", created["id"]] if change == "revoke" else ["admin", "tenant", "suspend", name]
        rc, _, err = await cli(capsys, *argv, "--database-url", pg_url)
        assert rc == 0, err
        assert f"invalidating on the servers' Redis at {redis_url}" in err and "warning" not in err
        deadline = time.monotonic() + 1.0
        while (status := (await client.get("/v1/models", headers=tenant_key)).status_code) == 200:
            assert time.monotonic() < deadline, "the key still works a second after the CLI returned"
            await asyncio.sleep(0.05)
        assert status == 401


async def test_without_a_recorded_redis_url_the_change_is_made_with_a_warning(tmp_path, pg_url, capsys):
    await upgrade_async(pg_url)  # a database no server of this version has started on
    url = ["--database-url", pg_url]
    assert (await cli(capsys, "admin", "tenant", "create", "acme", *url))[0] == 0
    rc, out, err = await cli(capsys, "admin", "tenant", "suspend", "acme", *url, "--json")
    assert rc == 0 and '"status": "suspended"' in out
    assert err.startswith("warning: the servers have recorded no Redis URL"), err
    assert "up to 5 s" in err and "--redis-url" in err and "the suspension" in err
    rc, _, err = await cli(capsys, "admin", "tenant", "activate", "acme", *url)
    assert rc == 0 and err == ""  # a tenant let back in a few seconds late is no hole: no warning


async def test_servers_without_redis_need_no_warning(tmp_path, pg_url, capsys):
    keys: list[str] = []
    app = create_app(Settings(data_dir=str(tmp_path), database_url=pg_url), start_engine=False,
                     on_bootstrap_key=keys.append)
    async with AsyncTestClient(app, timeout=30):
        pass  # started once: it recorded that it runs without Redis (its auth cache lives 0.5 s)
    assert (await cli(capsys, "admin", "tenant", "create", "acme", "--database-url", pg_url))[0] == 0
    rc, _, err = await cli(capsys, "admin", "tenant", "suspend", "acme", "--database-url", pg_url)
    assert rc == 0 and err == "", err
