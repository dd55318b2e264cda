"""Fixtures shared by the integration tests."""

from __future__ import annotations

import pytest


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request, tmp_path):
    """A database URL for each backend: a SQLite file, and a fresh PostgreSQL database dropped afterwards."""
    if request.param == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path / 'test.db'}"
        return
    from tests.e2e.server import FreshPostgres

    with FreshPostgres(request.getfixturevalue("postgres_url")) as url:
        yield url
