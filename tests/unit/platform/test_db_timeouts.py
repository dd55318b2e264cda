"""A PostgreSQL that accepts connections and never answers costs a few seconds (LORAPLEX_DATABASE_CONNECT_TIMEOUT_S),
not asyncpg's default minute; the timeouts are settings, refused by name when out of range."""

from __future__ import annotations

import time

import pytest
from sqlalchemy import text

from loraplex.cli import main
from loraplex.platform.db import make_engine
from loraplex.settings import ConfigError, Settings
from tests.integration.tcp_proxy import SilentListener


def silent_url(listener: SilentListener) -> str:
    return f"postgresql+asyncpg://ops:s3cret@127.0.0.1:{listener.port}/loraplex"


async def test_a_connect_to_a_silent_database_gives_up_after_the_connect_timeout():
    with SilentListener() as listener:
        settings = Settings.from_env({"LORAPLEX_DATABASE_CONNECT_TIMEOUT_S": "1"})
        engine = make_engine(silent_url(listener), settings)
        started = time.monotonic()
        try:
            with pytest.raises(TimeoutError):
                async with engine.connect() as conn:
                    await conn.execute(text("SELECT 1"))
        finally:
            await engine.dispose()
        assert 0.9 <= time.monotonic() - started < 5
        assert listener.conns, "the client never reached the listener: the test measured something else"


def test_the_default_connect_timeout_is_a_few_seconds():
    assert 1 <= Settings().database_connect_timeout_s <= 10
    assert 1 <= Settings().database_pool_timeout_s <= 30


def test_the_cli_names_a_silent_database_in_one_line_within_the_timeout(capsys, monkeypatch):
    monkeypatch.setenv("LORAPLEX_DATABASE_CONNECT_TIMEOUT_S", "1")
    with SilentListener() as listener:
        started = time.monotonic()
        rc = main(["admin", "tenant", "list", "--database-url", silent_url(listener)])
        elapsed = time.monotonic() - started
    err = capsys.readouterr().err
    assert rc == 1 and elapsed < 5, (rc, elapsed, err)
    assert err.strip().splitlines() == [
        f"error: cannot connect to the database at postgresql+asyncpg://ops:***@127.0.0.1:{listener.port}/loraplex: "
        "no answer within 1 s (--database-url / LORAPLEX_DATABASE_URL)"]


@pytest.mark.parametrize("name, value", [("CONNECT", "0"), ("POOL", "-1"), ("COMMAND", "nan"), ("CONNECT", "1e9")])
def test_an_out_of_range_timeout_is_refused_by_name(name, value):
    settings = Settings.from_env({f"LORAPLEX_DATABASE_{name}_TIMEOUT_S": value})
    with pytest.raises(ConfigError, match=f"LORAPLEX_DATABASE_{name}_TIMEOUT_S must be"):
        make_engine("postgresql+asyncpg://u@127.0.0.1/x", settings)


def test_sqlite_takes_no_server_timeouts(tmp_path):
    # the embedded default has no connection to open: a server database's timeouts never refuse it
    settings = Settings(database_command_timeout_s=-1)
    assert make_engine(f"sqlite+aiosqlite:///{tmp_path / 'x.db'}", settings) is not None


@pytest.mark.parametrize("how", ["db upgrade", "migrate.upgrade"])
def test_migrations_against_a_silent_database_give_up_after_the_connect_timeout(how, capsys, monkeypatch):
    # `loraplex db upgrade` checks the database first; the migration's own engine (migrations/env.py, also what a
    # server runs at start and what `alembic upgrade` runs) held on for asyncpg's default minute, or longer
    from loraplex.platform import cli, migrate

    monkeypatch.setenv("LORAPLEX_DATABASE_CONNECT_TIMEOUT_S", "1")
    with SilentListener() as listener:
        url = silent_url(listener)
        started = time.monotonic()
        if how == "db upgrade":
            async def answers(_settings):  # the database answered the check, then went silent
                return None

            monkeypatch.setattr(cli, "check_database", answers)
            assert main(["db", "upgrade", "--database-url", url]) == 1
            err = capsys.readouterr().err.strip().splitlines()
        else:
            with pytest.raises(ConfigError) as raised:
                migrate.upgrade(url)
            err = [f"error: {raised.value}"]
        elapsed = time.monotonic() - started
        assert listener.conns, "the migration never reached the listener: the test measured something else"
    assert elapsed < 5, elapsed
    assert err == [
        f"error: cannot connect to the database at postgresql+asyncpg://ops:***@127.0.0.1:{listener.port}/loraplex: "
        "no answer within 1 s (--database-url / LORAPLEX_DATABASE_URL)"], err
