"""Models and Alembic migrations agree on SQLite (no pending autogenerate diff); upgrade is idempotent."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from loraplex.platform.db import Base, make_engine
from loraplex.platform.migrate import import_all_models, migrations_dir, upgrade_async


async def _diff(url: str) -> list:
    import_all_models()
    engine = make_engine(url)
    try:
        async with engine.connect() as conn:
            def compare(sync_conn):
                ctx = MigrationContext.configure(sync_conn, opts={"compare_type": True, "render_as_batch": True})
                return compare_metadata(ctx, Base.metadata)

            return await conn.run_sync(compare)
    finally:
        await engine.dispose()


async def test_sqlite_models_match_migrations(tmp_path):
    url = f"sqlite+aiosqlite:///{tmp_path / 'm.db'}"
    await upgrade_async(url)
    await upgrade_async(url)  # second run is a no-op
    assert await _diff(url) == []


def test_migrations_ship_inside_the_package():
    import importlib.util

    spec = importlib.util.find_spec("loraplex.migrations_pkg")
    assert spec is not None, "loraplex/migrations_pkg (link to migrations/) is missing"
    pkg_dir = next(iter(spec.submodule_search_locations))
    from pathlib import Path

    assert (Path(pkg_dir) / "env.py").is_file() and (Path(pkg_dir) / "versions" / "0001_core.py").is_file()
    assert (migrations_dir() / "env.py").is_file()
