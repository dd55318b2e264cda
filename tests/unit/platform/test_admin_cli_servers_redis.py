"""The Redis URL the servers record for the CLI (platform/deployment.py) never holds a password, and when the CLI
cannot use or reach it, a revocation is still made, with a warning that names the delay and --redis-url."""

from __future__ import annotations

import asyncio
import json
import socket

import pytest

from loraplex.cli import main
from loraplex.platform import deployment
from loraplex.platform.db import make_engine, make_session_factory
from loraplex.settings import ConfigError, Settings, hide_passwords, url_with_password


@pytest.mark.parametrize("url, recorded", [
    ("redis://:s3cret@redis.internal:6379/0", "redis://:***@redis.internal:6379/0"),
    ("rediss://ops:s3cret@redis.internal:6380/2?ssl_cert_reqs=none", "rediss://ops:***@redis.internal:6380/2?ssl_cert_reqs=none"),
    ("redis://redis.internal:6379/0?password=s3cret", "redis://redis.internal:6379/0?password=***"),
    ("rediss://:s3cret@redis.internal:6380/0?ssl_password=k3y", "rediss://:***@redis.internal:6380/0?ssl_password=***"),
    ("redis://ops@redis.internal:6379/0", "redis://ops@redis.internal:6379/0"),
    ("redis://redis.loraplex.svc:6379/0", "redis://redis.loraplex.svc:6379/0"),
])
def test_a_recorded_url_keeps_everything_but_the_password(url, recorded):
    assert hide_passwords(url) == recorded
    assert deployment.password_hidden(recorded) == ("s3cret" in url)


@pytest.mark.parametrize("url, password, usable", [
    ("redis://:***@redis.internal:6379/0", "s3cret", "redis://:s3cret@redis.internal:6379/0"),
    ("rediss://ops:***@redis.internal:6380/2?ssl_cert_reqs=none", "p@ss/w:rd",
     "rediss://ops:p%40ss%2Fw%3Ard@redis.internal:6380/2?ssl_cert_reqs=none"),
    ("redis://redis.internal:6379/0?password=***&health_check_interval=5", "s3cret",
     "redis://redis.internal:6379/0?password=s3cret&health_check_interval=5"),
    ("redis://ops@redis.internal:6379/0", "s3cret", "redis://ops:s3cret@redis.internal:6379/0"),
    ("redis://redis.internal:6379/0", "s3cret", "redis://:s3cret@redis.internal:6379/0"),
    ("unix:///run/redis.sock?db=1", "s3cret", "unix:///run/redis.sock?db=1&password=s3cret"),
])
def test_the_password_goes_where_the_recorded_url_hides_it(url, password, usable):
    import redis

    assert url_with_password(url, password) == usable
    assert redis.Redis.from_url(usable).get_connection_kwargs()["password"] == password  # as redis-py reads it
    assert deployment.password_hidden(hide_passwords(usable))  # what a server given it records


def test_a_redis_password_set_twice_is_refused_naming_both():
    settings = Settings(redis_url="redis://:one@redis:6379/0", redis_password="two")
    with pytest.raises(ConfigError, match="LORAPLEX_REDIS_URL holds a password and LORAPLEX_REDIS_PASSWORD another"):
        _ = settings.effective_redis_url
    assert Settings(redis_url="redis://redis:6379/0", redis_password="two").effective_redis_url == \
        "redis://:two@redis:6379/0"
    assert Settings(redis_password="two").effective_redis_url is None


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def record(data_dir: str, redis_url: str) -> None:
    """What a server started on this data dir with ``redis_url`` records."""
    async def run() -> None:
        engine = make_engine(f"sqlite+aiosqlite:///{data_dir}/loraplex.db")
        try:
            await deployment.record_redis_url(make_session_factory(engine), redis_url)
            assert await deployment.servers_redis_url(make_session_factory(engine)) == \
                hide_passwords(redis_url)
        finally:
            await engine.dispose()

    asyncio.run(run())


@pytest.mark.parametrize("servers_redis, why", [
    ("redis://:s3cret@127.0.0.1:{port}/0", "whose password is not recorded (set LORAPLEX_REDIS_PASSWORD to it)"),
    ("redis://127.0.0.1:{port}/0", "does not answer here: cannot reach Redis at redis://127.0.0.1:{port}/0"),
])
def test_a_revocation_the_cli_cannot_publish_is_made_with_a_warning(servers_redis, why, tmp_path, capsys,
                                                                   monkeypatch):
    monkeypatch.delenv("LORAPLEX_REDIS_URL", raising=False)
    data = str(tmp_path / "data")
    assert main(["admin", "tenant", "create", "acme", "--data-dir", data]) == 0
    capsys.readouterr()
    assert main(["admin", "key", "create", "--tenant", "acme", "--data-dir", data, "--json"]) == 0
    key_id = json.loads(capsys.readouterr().out)["id"]
    port = closed_port()
    record(data, servers_redis.format(port=port))

    assert main(["admin", "key", "revoke", key_id, "--data-dir", data]) == 0
    out, err = capsys.readouterr()
    assert out == f"revoked {key_id}\n"
    assert why.format(port=port) in err and "s3cret" not in err
    assert "the revocation reaches servers that use Redis only when their auth cache expires, up to 5 s" in err
    assert "pass --redis-url" in err
    assert main(["admin", "key", "list", "--data-dir", data, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["revoked_at"] is not None
