"""What the servers record in the database for the ``loraplex`` CLI: the Redis URL they listen on for auth
invalidations.

``loraplex admin key revoke`` (or ``tenant suspend``) publishes an invalidation that every replica's auth cache
hears within a second (SECURITY.md 5), but only on the Redis the replicas use. Run with ``--database-url`` alone, the
CLI reached no replica: servers on Redis kept accepting a revoked key for their cache's whole TTL. Every server
therefore records at start the Redis URL it uses ('' without Redis), and the CLI falls back to it
(``cli_admin.py``). The password is never recorded (the database and its backups are read more widely than the
deployment's secrets): the recorded URL holds ``***`` in its place, and the CLI puts ``LORAPLEX_REDIS_PASSWORD`` there
(the deployment's secret); without it, the CLI says what to pass.
"""

from __future__ import annotations

import logging

from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.exc import OperationalError, ProgrammingError, SQLAlchemyError

from loraplex.platform.db import SessionFactory, utcnow
from loraplex.platform.models import DeploymentSetting
from loraplex.settings import HIDDEN_PASSWORD, hide_passwords, url_password

log = logging.getLogger(__name__)

REDIS_URL = "redis_url"


def password_hidden(url: str) -> bool:
    """Whether a recorded URL had a password (so it cannot be used as it stands)."""
    return url_password(url) == HIDDEN_PASSWORD


async def record_redis_url(sessions: SessionFactory, redis_url: str | None) -> None:
    """At server start: the Redis URL this server takes invalidations from ('' without Redis), password hidden.
    The last server to start wins; replicas of one deployment share their Redis."""
    value = hide_passwords(redis_url) if redis_url else ""
    try:
        async with sessions() as session:
            insert = pg_insert if session.bind.dialect.name == "postgresql" else sqlite_insert
            now = utcnow()
            stmt = insert(DeploymentSetting).values(name=REDIS_URL, value=value, updated_at=now)
            await session.execute(stmt.on_conflict_do_update(index_elements=["name"],
                                                             set_={"value": value, "updated_at": now}))
            await session.commit()
    except SQLAlchemyError as exc:  # the server runs without it; only the CLI's fallback is lost
        log.warning("could not record the Redis URL for the loraplex CLI in the database: %s", exc)


async def servers_redis_url(sessions: SessionFactory) -> str | None:
    """What the servers recorded: a Redis URL (its password, if any, as ``***``), '' when they run without Redis,
    None when nothing is (no server of this version has started on this database yet)."""
    try:
        async with sessions() as session:
            return (await session.execute(
                select(DeploymentSetting.value).where(DeploymentSetting.name == REDIS_URL))).scalar_one_or_none()
    except (OperationalError, ProgrammingError):  # no such table: a database not upgraded yet
        return None
