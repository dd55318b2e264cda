"""Alembic environment: async, for both SQLite (batch mode) and PostgreSQL.

The database URL comes from the Alembic config (``sqlalchemy.url``), which
:func:`loraplex.platform.migrate.alembic_config` fills from the settings. A connection may also be
passed in ``config.attributes["connection"]`` (tests do this to share one connection).
"""

from __future__ import annotations

import asyncio
import time

from alembic import context
from sqlalchemy.exc import DBAPIError

from loraplex.platform.db import Base, make_engine
from loraplex.platform.migrate import PG_STARTUP_LOCK, cannot_connect, import_all_models
from loraplex.settings import Settings

import_all_models()
config = context.config
target_metadata = Base.metadata


def _configure(connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
        compare_server_default=False,
    )


def _run_sync(connection) -> None:
    _configure(connection)
    with context.begin_transaction():
        if connection.dialect.name == "postgresql":  # replicas starting together must not migrate twice
            connection.exec_driver_sql(f"SELECT pg_advisory_xact_lock({PG_STARTUP_LOCK})")
        context.run_migrations()


async def _run_async(url: str, settings: Settings) -> None:
    # the servers' connect timeout (LORAPLEX_DATABASE_CONNECT_TIMEOUT_S): a database that does not answer is an
    # error naming it within seconds, not a wait of asyncpg's minute (or forever). No statement limit: a migration
    # may rewrite a large table, and a replica waits in the advisory lock while another one migrates
    engine = make_engine(url, settings, statement_timeout=False)
    started = time.monotonic()
    try:
        try:
            connection = await engine.connect()
        except (DBAPIError, OSError, TimeoutError) as exc:
            raise cannot_connect(url, exc, time.monotonic() - started) from exc
        try:
            await connection.run_sync(_run_sync)
            await connection.commit()
        finally:
            await connection.close()
    finally:
        await engine.dispose()


def run_migrations_offline() -> None:
    context.configure(
        url=config.get_main_option("sqlalchemy.url"),
        target_metadata=target_metadata,
        literal_binds=True,
        render_as_batch=config.get_main_option("sqlalchemy.url", "").startswith("sqlite"),
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run_sync(connection)
        return
    settings = config.attributes.get("settings") or Settings.from_env()
    asyncio.run(_run_async(config.get_main_option("sqlalchemy.url"), settings))


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
