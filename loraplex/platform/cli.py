"""``loraplex serve``, ``loraplex db upgrade``, ``loraplex admin tenant|key ...``.

Every command reads the same :class:`~loraplex.settings.Settings` (``--data-dir``, env ``LORAPLEX_*``),
so ``loraplex admin ...`` run beside a server acts on that server's database. Other areas add
their subcommands through :data:`EXTRA_CLI_MODULES` (each exposes ``register(subparsers)``).
"""

from __future__ import annotations

import argparse
import importlib

from loraplex.settings import Settings

# other areas' subcommands (adapter ..., usage export); skipped until they exist
EXTRA_CLI_MODULES = (
    "loraplex.platform.registry.cli",
    "loraplex.platform.usage.cli",
)


def add_common(parser: argparse.ArgumentParser) -> None:
    """Flags every platform command accepts after its name (they also work before it)."""
    parser.add_argument("--data-dir", default=argparse.SUPPRESS, help="state directory (env LORAPLEX_DATA_DIR)")
    parser.add_argument("--database-url", default=argparse.SUPPRESS,
                        help="e.g. postgresql+asyncpg://user@host/db (env LORAPLEX_DATABASE_URL)")
    parser.add_argument("--redis-url", default=argparse.SUPPRESS, help="e.g. redis://host:6379/0 (env LORAPLEX_REDIS_URL)")


def settings_from_args(args: argparse.Namespace, **extra) -> Settings:
    """Environment first, then flags (the one way every platform command builds its settings)."""
    return Settings.from_env(
        data_dir=getattr(args, "data_dir", None),
        database_url=getattr(args, "database_url", None),
        redis_url=getattr(args, "redis_url", None),
        **extra,
    )


def register(subparsers) -> None:
    from loraplex.platform import cli_admin, cli_serve

    cli_serve.register(subparsers)
    db = subparsers.add_parser("db", help="database migrations")
    db_sub = db.add_subparsers(dest="db_command", metavar="ACTION", required=True)
    up = db_sub.add_parser("upgrade", help="apply Alembic migrations (to head)")
    add_common(up)
    up.add_argument("--revision", default="heads", help="target revision (default: heads)")
    up.set_defaults(func=_db_upgrade)
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
    if settings.effective_database_url.startswith("sqlite"):
        settings.data_path.mkdir(parents=True, exist_ok=True)
    migrate.upgrade(settings.effective_database_url, args.revision)
    print(f"database at {migrate.redact(settings.effective_database_url)} is at {args.revision}")
    return 0
