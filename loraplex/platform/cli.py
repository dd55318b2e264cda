"""``loraplex serve``, ``loraplex db upgrade``, ``loraplex admin tenant|key ...``.

Every command reads the same :class:`~loraplex.settings.Settings` (``--data-dir``, env ``LORAPLEX_*``),
so ``loraplex admin ...`` run beside a server acts on that server's database. Other areas add
their subcommands through :data:`EXTRA_CLI_MODULES` (each exposes ``register(subparsers)``).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import importlib
import math
import os
import re
import sys
import time

from loraplex.settings import ConfigError, Settings, hide_passwords

CONNECT_TIMEOUT_S = 10.0
DATABASE_FILE = "loraplex.db"

# other areas' subcommands (adapter ..., usage export); skipped until they exist
EXTRA_CLI_MODULES = (
    "loraplex.platform.registry.cli",
    "loraplex.platform.usage.cli",
)


# the largest count any flag takes (C int in torch and the kernels; a Postgres integer column)
MAX_FLAG_INT = 2**31 - 1


class FlagError(ConfigError):
    """A flag value no run could use (a port over 65535, a negative timeout, an unknown revision).

    Platform commands print it as one ``error:`` line naming the flag and the limit and exit 2 (a usage
    error), before anything is changed; see :func:`flag_checked`."""


def flag_checked(func):
    """Wrap a command's ``func``: a :class:`FlagError` is one ``error:`` line and exit code 2."""

    @functools.wraps(func)
    def run(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except FlagError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2

    return run


def check_int(flag: str, value: int | None, least: int, most: int = MAX_FLAG_INT, note: str = "") -> None:
    """``least <= value <= most`` (None: not given), else a FlagError naming ``flag``."""
    if value is not None and not least <= value <= most:
        raise FlagError(f"{flag} must be at least {least} and at most {most}{note}, got {value}")


def check_seconds(flag: str, value: float | None, *, zero_ok: bool, most: float) -> None:
    """A finite number of seconds, more than 0 (or at least 0 with ``zero_ok``) and at most ``most``."""
    if value is None:
        return
    low_ok = value >= 0 if zero_ok else value > 0
    if not (math.isfinite(value) and low_ok and value <= most):
        low = "at least 0" if zero_ok else "more than 0"
        raise FlagError(f"{flag} must be {low} and at most {most:g} seconds, got {value:g}")


def add_common(parser: argparse.ArgumentParser) -> None:
    """Flags every platform command accepts after its name (they also work before it)."""
    parser.add_argument("--data-dir", default=argparse.SUPPRESS, help="state directory (env LORAPLEX_DATA_DIR)")
    parser.add_argument("--database-url", default=argparse.SUPPRESS,
                        help="e.g. postgresql+asyncpg://user@host/db (env LORAPLEX_DATABASE_URL)")
    parser.add_argument("--redis-url", default=argparse.SUPPRESS, help="e.g. redis://host:6379/0 (env LORAPLEX_REDIS_URL)")


def flag_error(exc, flags: dict[str, str]) -> str:
    """An API error as the CLI's one ``error:`` line, naming the flag the operator typed
    (``--requests-per-minute``) instead of the API field behind it (``requests_per_minute``)."""
    message = exc.message
    for field, flag in flags.items():
        if "_" in field:  # API spellings (requests_per_minute, expires_at): never ordinary words
            message = re.sub(rf"(?<![\w-]){re.escape(field)}(?![\w-])", flag, message)
    flag = flags.get(exc.param or "")
    if flag and not message.startswith(flag):
        if message.startswith(f"{exc.param} "):
            message = flag + message[len(exc.param):]
        else:
            message = f"{flag}: {message}"
    return "error: " + message.replace("(or null for ", "(or leave the flag out for ")


def settings_from_args(args: argparse.Namespace, **extra) -> Settings:
    """Environment first, then flags (the one way every platform command builds its settings)."""
    return Settings.from_env(
        data_dir=getattr(args, "data_dir", None),
        database_url=getattr(args, "database_url", None),
        redis_url=getattr(args, "redis_url", None),
        **extra,
    )


def prepare_data_dir(settings: Settings, *, must_exist: bool = False) -> bool:
    """Make sure the embedded default's data dir is usable; returns True if its database is new.

    ``must_exist`` is for commands that only read: a mistyped ``--data-dir`` must be an error, not an
    empty database created on the spot.
    """
    if settings.database_url:
        return False
    path = settings.data_path
    if (path / DATABASE_FILE).is_file():
        return False
    if must_exist:
        raise ConfigError(f"no Loraplex database in {path} (no server has run with this data dir): check "
                          "--data-dir / LORAPLEX_DATA_DIR, or pass --database-url")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"data dir {path} cannot be created: {exc.strerror} (--data-dir / LORAPLEX_DATA_DIR)") \
            from exc
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"data dir {path} is not writable by this user (--data-dir / LORAPLEX_DATA_DIR)")
    return True


async def check_database(settings: Settings) -> None:
    """Connect once (``SELECT 1``): a bad URL or an unreachable database is a one-line ConfigError."""
    from sqlalchemy import text
    from sqlalchemy.exc import ArgumentError, SQLAlchemyError

    from loraplex.platform.db import make_engine
    from loraplex.platform.migrate import cannot_connect, driver_reason

    url = settings.effective_database_url
    shown = hide_passwords(url)
    try:
        engine = make_engine(url, settings)
    except (ArgumentError, ImportError) as exc:
        raise ConfigError(f"database URL {shown} is not usable ({driver_reason(exc)}); expected "
                          "postgresql+asyncpg://USER@HOST:5432/DB or sqlite+aiosqlite:///PATH "
                          "(--database-url / LORAPLEX_DATABASE_URL)") from exc
    async def select_one() -> None:
        async with engine.connect() as conn:
            await conn.execute(text("SELECT 1"))

    # the engine's own connect timeout (LORAPLEX_DATABASE_CONNECT_TIMEOUT_S) fires first on a server database;
    # this bounds the SELECT and SQLite
    limit = settings.database_connect_timeout_s + CONNECT_TIMEOUT_S
    started = time.monotonic()
    try:
        await asyncio.wait_for(select_one(), limit)
    except (SQLAlchemyError, OSError, asyncio.TimeoutError) as exc:
        raise cannot_connect(url, exc, time.monotonic() - started) from exc
    finally:
        await engine.dispose()


async def check_redis(url: str) -> None:
    """PING once: a bad URL or an unreachable Redis is a one-line ConfigError."""
    import redis.asyncio as redis
    from redis.exceptions import RedisError

    from loraplex.platform.migrate import driver_reason

    shown = hide_passwords(url)
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=CONNECT_TIMEOUT_S,
                                      socket_timeout=CONNECT_TIMEOUT_S)
    except ValueError as exc:
        raise ConfigError(f"Redis URL {shown} is not usable ({exc}); expected redis://HOST:6379/0 "
                          "(--redis-url / LORAPLEX_REDIS_URL)") from exc
    try:
        await client.ping()
    except (RedisError, OSError) as exc:
        raise ConfigError(f"cannot reach Redis at {shown}: {driver_reason(exc)} (--redis-url / LORAPLEX_REDIS_URL)") \
            from exc
    finally:
        await client.aclose()


async def check_services(settings: Settings, *, must_exist: bool = False, redis: bool = True) -> bool:
    """Before a command changes anything: the data dir, the database and Redis all answer.

    Returns True when the embedded database is new (see :func:`prepare_data_dir`).
    """
    new = prepare_data_dir(settings, must_exist=must_exist)
    await check_database(settings)
    if redis and settings.redis_url:
        await check_redis(settings.effective_redis_url)
    return new


def register(subparsers) -> None:
    from loraplex.platform import cli_admin, cli_serve

    cli_serve.register(subparsers)
    db = subparsers.add_parser("db", help="database migrations")
    db_sub = db.add_subparsers(dest="db_command", metavar="ACTION", required=True)
    up = db_sub.add_parser("upgrade", help="apply Alembic migrations (to head)")
    add_common(up)
    up.add_argument("--revision", default="heads", help="target revision (default: heads)")
    up.set_defaults(func=flag_checked(_db_upgrade))
    cli_admin.register(subparsers)
    for path in EXTRA_CLI_MODULES:
        try:
            module = importlib.import_module(path)
        except ModuleNotFoundError as exc:
            if exc.name and path.startswith(exc.name):
                continue
            raise
        module.register(subparsers)


def _db_upgrade(args: argparse.Namespace) -> int:
    from loraplex.platform import migrate

    settings = settings_from_args(args)
    url = settings.effective_database_url
    _check_revision(url, args.revision)  # before the data dir or the database is touched
    from alembic.util import CommandError  # (after alembic's logging is quieted)

    prepare_data_dir(settings)
    asyncio.run(check_database(settings))
    try:
        migrate.upgrade(url, args.revision, settings)
    except CommandError as exc:  # a relative target (+N) the database's state cannot reach
        raise FlagError(f"--revision {args.revision}: {exc}") from None
    if args.revision in ("head", "heads"):
        print(f"database at {hide_passwords(url)} is at the latest revision ({', '.join(sorted(migrate.current_heads(url)))})")
    else:
        print(f"database at {hide_passwords(url)} is at revision {args.revision}")
    return 0


def _check_revision(url: str, revision: str) -> None:
    """An absolute target must name a known revision (relative ones, ``+N``, depend on the database)."""
    from loraplex.platform import migrate

    if not revision.strip():
        raise FlagError("--revision must not be empty (default: heads)")
    config = migrate.alembic_config(url)  # before any alembic import: it quiets alembic's import-time log lines
    if revision.startswith("+"):
        return
    from alembic.script import ScriptDirectory
    from alembic.util import CommandError

    script = ScriptDirectory.from_config(config)
    try:
        script.get_revisions(revision)
    except CommandError as exc:
        known = ", ".join(sorted(s.revision for s in script.walk_revisions()))
        raise FlagError(f"--revision {revision}: {exc} (known: heads, base, {known})") from None
