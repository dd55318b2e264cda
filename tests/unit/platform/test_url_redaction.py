"""Service URLs shown in messages never carry a password, wherever the URL holds it."""

from __future__ import annotations

import asyncio
import socket

import pytest

from loraplex.platform.cli import check_redis
from loraplex.platform.migrate import cannot_connect
from loraplex.settings import ConfigError, Settings, hide_passwords

SECRET = "s3cretPW"


@pytest.mark.parametrize("url", [
    f"redis://:{SECRET}@host:6379/0",
    f"redis://host:6379/0?password={SECRET}",
    f"redis://host:6379/0?db=1&Password={SECRET}",
    f"redis://host:6379/0?pass%77ord={SECRET}",
    f"redis://host:6379/0?password=ab#{SECRET}",
    f"unix:///run/redis.sock?db=0&password={SECRET}",
    f"postgresql+asyncpg://app@db:5432/prod?password={SECRET}",
    f"postgresql+asyncpg://app:{SECRET}@db:5432/prod?sslpassword={SECRET}",
])
def test_hide_passwords_hides_a_password_in_the_user_part_or_the_query(url):
    shown = hide_passwords(url)
    assert SECRET not in shown
    assert "***" in shown


def test_hide_passwords_of_an_at_sign_in_the_password_or_a_url_that_does_not_parse():
    assert hide_passwords(f"postgresql+asyncpg://app:{SECRET}@x@db:5432/prod") == \
        "postgresql+asyncpg://app:***@db:5432/prod"
    shown = hide_passwords(f"redis://:{SECRET}@[::1:6379/0")  # an unclosed IPv6 host: urlsplit refuses it
    assert SECRET not in shown and "does not parse" in shown


def test_hide_passwords_keeps_the_rest_of_the_url():
    assert hide_passwords("redis://host:6379/0?db=2&password=x") == "redis://host:6379/0?db=2&password=***"
    assert hide_passwords("postgresql+asyncpg://app@db:5432/prod") == "postgresql+asyncpg://app@db:5432/prod"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_redis_socket_with_the_secret_password_is_named_without_it(tmp_path):
    # LORAPLEX_REDIS_PASSWORD with a unix-socket URL: the password travels as a query argument
    url = Settings(data_dir=str(tmp_path), redis_url=f"unix://{tmp_path}/none.sock",
                   redis_password=SECRET).effective_redis_url
    assert SECRET in url
    with pytest.raises(ConfigError) as err:
        asyncio.run(check_redis(url))
    assert SECRET not in str(err.value)
    with pytest.raises(ConfigError) as err:
        asyncio.run(check_redis(f"redis://127.0.0.1:{_closed_port()}/0?password={SECRET}"))
    assert SECRET not in str(err.value) and "cannot reach Redis" in str(err.value)


def test_cannot_connect_names_the_database_without_a_query_password():
    exc = cannot_connect(f"postgresql+asyncpg://app@127.0.0.1:1/prod?password={SECRET}", OSError("refused"), 0.1)
    assert SECRET not in str(exc)
