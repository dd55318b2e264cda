"""Alembic environment: async, for both SQLite (batch mode) and PostgreSQL.

The database URL comes from the Alembic config (``sqlalchemy.url``), which
:func:`loraplex.platform.migrate.alembic_config` fills from the settings. A connection may also be
passed in ``config.attributes["connection"]`` (tests do this to share one connection).
"""

from __future__ import annotations

import asyncio

from alembic import context
from sqlalchemy.ext.asyncio import create_async_engine

from loraplex.platform.db import Base
from loraplex.platform.migrate import PG_STARTUP_LOCK, import_all_models

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


async def _run_async(url: str) -> None:
    engine = create_async_engine(url)
    try:
        async with engine.connect() as connection:
            await connection.run_sync(_run_sync)
            await connection.commit()
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
    asyncio.run(_run_async(config.get_main_option("sqlalchemy.url")))


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
