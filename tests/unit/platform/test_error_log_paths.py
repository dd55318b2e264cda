"""The error logs of 5xx answers (an unhandled error, an unreachable database or Redis) name the request's path as the
access log does: an API key's secret in it redacted, control characters escaped, its length bounded."""

from __future__ import annotations

import logging

import pytest
import redis.exceptions
from litestar import Litestar, get
from litestar.testing import TestClient
from sqlalchemy.exc import OperationalError

from loraplex.platform.errors import exception_handlers
from loraplex.platform.middleware import MAX_LOGGED_PATH_CHARS

FAULTS = {
    "internal": RuntimeError("a bug"),
    "database": OperationalError("SELECT 1", {}, ConnectionRefusedError("refused")),
    "redis": redis.exceptions.ConnectionError("refused"),
}
SECRET = "S" * 40
KEY = "lpx-abcdefghijkl-" + SECRET


@get("/fail/{fault:str}/{rest:path}")
async def fail(fault: str, rest: str) -> str:
    raise FAULTS[fault]


@pytest.mark.parametrize("fault, status", [("internal", 500), ("database", 503), ("redis", 503)])
def test_a_5xx_logs_the_path_without_a_key_secret_or_a_forged_line(fault, status, caplog):
    app = Litestar([fail], exception_handlers=exception_handlers(), logging_config=None)
    caplog.set_level(logging.WARNING, logger="loraplex")
    with TestClient(app, raise_server_exceptions=False) as client:
        r = client.get(f"/fail/{fault}/{KEY}%0A2026-12-08 ERROR forged/" + "x" * 1000)
    assert r.status_code == status, r.text
    (record,) = [r for r in caplog.records if r.name.startswith("loraplex") and " on GET " in r.getMessage()]
    message = record.getMessage()
    assert SECRET not in message and "lpx-abcdefghijkl-[redacted]" in message
    assert "\n" not in message.split(" on GET ", 1)[1].split(": ", 1)[0]  # the forged line stays on this one
    assert "\\n2026-12-08 ERROR forged" in message
    assert "x" * (MAX_LOGGED_PATH_CHARS + 1) not in message
