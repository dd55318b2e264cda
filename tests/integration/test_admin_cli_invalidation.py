"""``loraplex admin key revoke`` / ``tenant suspend`` run with ``--database-url`` alone (no ``--redis-url``, no
LORAPLEX_REDIS_URL) still reach every replica on Redis within a second (SECURITY.md 5): the servers record their
Redis URL in the database and the CLI publishes there. Where it cannot, it still makes the change and says on
stderr how long servers keep the old state and what to pass. It used to print "revoked", exit 0, and leave the key
working on every replica for their auth cache's TTL (5 s)."""

from __future__ import annotations

import asyncio
import secrets
import time
from urllib.parse import quote

import pytest
from litestar.testing import AsyncTestClient

from loraplex.cli import main
from loraplex.platform.app import create_app
from loraplex.platform.migrate import upgrade_async
from loraplex.settings import Settings
from tests.e2e.server import FreshPostgres


@pytest.fixture
def pg_url(postgres_url, monkeypatch):
    for name in ("LORAPLEX_REDIS_URL", "LORAPLEX_REDIS_PASSWORD", "LORAPLEX_DATABASE_URL"):
        monkeypatch.delenv(name, raising=False)
    with FreshPostgres(postgres_url) as url:
        yield url


async def cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = await asyncio.to_thread(main, list(argv))  # main runs its own event loop
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
def redis_user(redis_url):
    """(user, password) of a Redis ACL user made for the test: a Redis that needs a password."""
    import redis

    client = redis.Redis.from_url(redis_url)
    user, password = f"loraplex-test-{secrets.token_hex(4)}", secrets.token_urlsafe(12) + "@/:"
    client.acl_setuser(user, enabled=True, passwords=[f"+{password}"], keys=["*"], channels=["*"],
                       commands=["+@all"])
    try:
        yield user, password
    finally:
        client.acl_deluser(user)
        client.close()


def with_user(redis_url: str, user: str, password: str | None = None) -> str:
    secret = f":{quote(password, safe='')}" if password else ""
    return redis_url.replace("redis://", f"redis://{user}{secret}@", 1)


async def revoke_from_the_cli_and_wait(client, admin, name: str, change: str, capsys, *cli_argv: str) -> str:
    """Create a key of tenant ``name``, revoke it (or suspend the tenant) from the CLI; the CLI's stderr, once every
    replica refuses the key (which must happen within a second of the CLI's return)."""
    assert (await client.post("/admin/tenants", json={"name": name}, headers=admin)).status_code == 201
    created = (await client.post("/admin/keys", json={"tenant": name}, headers=admin)).json()
    tenant_key = {"Authorization": f"Bearer {created['key']}"}
    assert (await client.get("/v1/models", headers=tenant_key)).status_code == 200  # now in the auth cache

    argv = ["admin", "key", "revoke", created["id"]] if change == "revoke" else ["admin", "tenant", "suspend", name]
    rc, _, err = await cli(capsys, *argv, *cli_argv)
    assert rc == 0, err
    deadline = time.monotonic() + 1.0
    while (status := (await client.get("/v1/models", headers=tenant_key)).status_code) == 200:
        assert time.monotonic() < deadline, f"the key still works a second after the CLI returned: {err}"
        await asyncio.sleep(0.05)
    assert status == 401
    return err


@pytest.mark.parametrize("servers_have", ["the password in the URL", "LORAPLEX_REDIS_PASSWORD"])
async def test_with_the_servers_redis_password_in_the_environment_the_cli_reaches_them(servers_have, tmp_path, pg_url,
                                                                                      redis_url, redis_user, capsys,
                                                                                      monkeypatch):
    # the database holds the servers' Redis URL without its password; the operator's LORAPLEX_REDIS_PASSWORD (the
    # deployment's secret) fills it in. It used to be refused, always: "whose password is not recorded"
    user, password = redis_user
    settings = Settings(data_dir=str(tmp_path), database_url=pg_url, redis_url=with_user(redis_url, user, password)) \
        if servers_have == "the password in the URL" else \
        Settings(data_dir=str(tmp_path), database_url=pg_url, redis_url=with_user(redis_url, user),
                 redis_password=password)
    keys: list[str] = []
    app = create_app(settings, start_engine=False, on_bootstrap_key=keys.append)
    async with AsyncTestClient(app, timeout=30) as client:
        admin = {"Authorization": f"Bearer {keys[0]}"}
        monkeypatch.setenv("LORAPLEX_REDIS_PASSWORD", password)
        err = await revoke_from_the_cli_and_wait(client, admin, "acme", "revoke", capsys, "--database-url", pg_url)
        recorded = redis_url.replace("redis://", f"redis://{user}:***@", 1)
        assert f"invalidating on the servers' Redis at {recorded}" in err and "warning" not in err, err
        assert password not in err

        monkeypatch.setenv("LORAPLEX_REDIS_PASSWORD", "not-the-password")
        rc, _, err = await cli(capsys, "admin", "tenant", "suspend", "acme", "--database-url", pg_url)
        assert rc == 0 and err.startswith("warning: the servers' Redis (recorded in the database) does not answer "
                                          "here"), err
        assert "not-the-password" not in err


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
