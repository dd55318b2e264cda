"""Database: one declarative ``Base``, one engine factory, one session factory (SQLAlchemy 2, async).

The embedded default is a SQLite file (WAL, foreign keys on); production is PostgreSQL over asyncpg.
Every area defines its tables on :class:`Base` so Alembic sees one metadata.
"""

from __future__ import annotations

import math
import uuid
from datetime import datetime, timezone

from sqlalchemy import MetaData, event
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import DeclarativeBase

from loraplex.settings import ENV_PREFIX, ConfigError, Settings

# constraint names are stable across SQLite and Postgres, so migrations can refer to them
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


def new_id() -> str:
    """A portable primary key: a UUID as a 32-char hex string."""
    return uuid.uuid4().hex


def as_utc(value: datetime | None) -> datetime | None:
    """SQLite returns naive datetimes even for ``DateTime(timezone=True)``; treat them as UTC."""
    if value is None or value.tzinfo is not None:
        return value
    return value.replace(tzinfo=timezone.utc)


def is_sqlite(url: str) -> bool:
    return url.startswith("sqlite")


def make_engine(url: str, settings: Settings | None = None, *, echo: bool = False,
                statement_timeout: bool = True) -> AsyncEngine:
    """An async engine for ``url`` (``sqlite+aiosqlite:///...`` or ``postgresql+asyncpg://...``).

    A server-side database gets the timeouts of ``settings`` (None: their defaults): opening a connection,
    waiting for one from the pool, one statement (``statement_timeout=False``: no limit, for migrations).
    SQLite has none of these (its busy timeout is fixed below)."""
    if is_sqlite(url):
        engine = create_async_engine(url, echo=echo, connect_args={"timeout": 30})
        _configure_sqlite(engine)
        return engine
    settings = settings or Settings()
    connect_s = _seconds(settings, "database_connect_timeout_s")
    pool_s = _seconds(settings, "database_pool_timeout_s")
    command_s = _seconds(settings, "database_command_timeout_s", zero_ok=True)
    connect_args = {}
    if make_url(url).get_driver_name() == "asyncpg":
        # asyncpg.connect(timeout=...): the whole connect, TCP to authenticated (its default is 60 s);
        # command_timeout: every statement's default, the pool's pre-ping included
        connect_args = {"timeout": connect_s, "command_timeout": (command_s or None) if statement_timeout else None}
    return create_async_engine(url, echo=echo, pool_pre_ping=True, pool_size=10, max_overflow=20,
                               pool_timeout=pool_s, connect_args=connect_args)


MAX_DATABASE_TIMEOUT_S = 3600.0


def _seconds(settings: Settings, name: str, *, zero_ok: bool = False) -> float:
    value = getattr(settings, name)
    low_ok = value >= 0 if zero_ok else value > 0
    if not (math.isfinite(value) and low_ok and value <= MAX_DATABASE_TIMEOUT_S):
        low = "at least 0 (0: no limit)" if zero_ok else "more than 0"
        raise ConfigError(f"{ENV_PREFIX}{name.upper()} must be {low} and at most {MAX_DATABASE_TIMEOUT_S:g} "
                          f"seconds, got {value:g}")
    return value


def _configure_sqlite(engine: AsyncEngine) -> None:
    @event.listens_for(engine.sync_engine, "connect")
    def _on_connect(dbapi_conn, _record):  # pragma: no cover - exercised by every SQLite test
        cur = dbapi_conn.cursor()
        # WAL lets the CLI write while a server reads; foreign keys are off by default in SQLite
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute("PRAGMA busy_timeout=30000")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.close()


SessionFactory = async_sessionmaker[AsyncSession]


def make_session_factory(engine: AsyncEngine) -> SessionFactory:
    return async_sessionmaker(engine, expire_on_commit=False, class_=AsyncSession)
