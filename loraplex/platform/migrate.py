"""Alembic, driven from code: ``loraplex db upgrade`` and the embedded default's first start.

Migrations live in the repository's top-level ``migrations/`` and ship inside the wheel as the
package ``loraplex.migrations_pkg`` (see pyproject.toml); :func:`migrations_dir` finds either.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
from pathlib import Path

from loraplex.settings import ConfigError, Settings, hide_passwords

# every module that defines tables on Base; a module not built yet is skipped
MODEL_MODULES = (
    "loraplex.platform.models",
    "loraplex.platform.registry.models",
    "loraplex.platform.usage.models",
)

HEAD = "heads"
# a Postgres advisory lock held, for one transaction, by the start-up work that replicas starting together must
# do once: migrations (migrations/env.py) and the bootstrap admin key (tenants.bootstrap_admin)
PG_STARTUP_LOCK = 0x6C707801


def import_all_models() -> None:
    for path in MODEL_MODULES:
        try:
            importlib.import_module(path)
        except ModuleNotFoundError as exc:
            if exc.name and path.startswith(exc.name):
                continue
            raise


def migrations_dir() -> Path:
    source_tree = Path(__file__).resolve().parents[2] / "migrations"
    if (source_tree / "env.py").is_file():
        return source_tree
    spec = importlib.util.find_spec("loraplex.migrations_pkg")
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    raise RuntimeError("Alembic migrations not found (neither ./migrations nor loraplex.migrations_pkg)")


def _quiet_alembic() -> None:
    import logging

    # alembic's per-step INFO lines (some at import) are noise for CLI users and server logs
    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
        logging.getLogger("alembic").setLevel(logging.WARNING)


def alembic_config(url: str, settings: Settings | None = None):
    """``settings``: the database timeouts migrations/env.py connects with (None: from the environment)."""
    _quiet_alembic()
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    # '%' is ConfigParser interpolation syntax; passwords may contain it
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    if settings is not None:
        cfg.attributes["settings"] = settings
    return cfg


def upgrade(url: str, revision: str = HEAD, settings: Settings | None = None) -> None:
    """Run migrations up to ``revision`` (blocking; call from a thread when inside an event loop). A database that
    cannot be reached is a ConfigError once ``settings``' connect timeout has passed."""
    _quiet_alembic()
    from alembic import command

    command.upgrade(alembic_config(url, settings), revision)


async def upgrade_async(url: str, revision: str = HEAD, settings: Settings | None = None) -> None:
    # env.py runs its own event loop, so it needs a thread of its own
    await asyncio.to_thread(upgrade, url, revision, settings)


def driver_reason(exc: BaseException) -> str:
    """The driver's own words, one line (SQLAlchemy wraps them with a class name and a link)."""
    inner = getattr(exc, "orig", None) or exc
    text = str(inner).strip() or type(inner).__name__
    return text.splitlines()[0]


def cannot_connect(url: str, exc: BaseException, waited_s: float) -> ConfigError:
    """The one-line error for a database that refused, failed or did not answer a connection (``exc``)."""
    reason = f"no answer within {waited_s:.0f} s" if isinstance(exc, TimeoutError) else driver_reason(exc)
    return ConfigError(f"cannot connect to the database at {hide_passwords(url)}: {reason} "
                       "(--database-url / LORAPLEX_DATABASE_URL)")


def current_heads(url: str) -> set[str]:
    from alembic.script import ScriptDirectory

    return set(ScriptDirectory.from_config(alembic_config(url)).get_heads())


async def begin_startup_lock(session) -> None:
    """Begin ``session``'s transaction holding the start-up lock until it commits or rolls back: on Postgres the
    advisory lock migrations take, on SQLite the database's write lock (``BEGIN IMMEDIATE``; a deferred
    transaction would read first and find out only at its first write that another process wrote meanwhile).
    What the transaction then reads includes everything a previous holder committed."""
    from sqlalchemy import text

    assert not session.in_transaction(), "the start-up lock must be the transaction's first statement"
    dialect = session.bind.dialect.name
    if dialect == "postgresql":
        await session.execute(text(f"SELECT pg_advisory_xact_lock({PG_STARTUP_LOCK})"))
    elif dialect == "sqlite":
        await session.execute(text("BEGIN IMMEDIATE"))
    else:
        raise AssertionError(f"no start-up lock for {dialect}")
