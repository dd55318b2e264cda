"""Operators' logs: JSON lines, a request id on every line logged while a request runs (the client's
``X-Request-Id`` when sane), and the opt-in access log, which never holds a key, a query string or a body."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys

import pytest
from litestar import Litestar, get
from litestar.testing import TestClient

from loraplex.log import TextFormatter, request_log_context
from loraplex.platform.app import create_app
from loraplex.platform.middleware import platform_middleware
from loraplex.settings import Settings
from tests.conftest import ROOT
from tests.log_lines import json_log_lines


@pytest.fixture
def json_lines():
    with json_log_lines() as lines:
        yield lines


def test_json_lines_have_the_keys_a_log_shipper_expects_and_exceptions_as_a_field(json_lines):
    log = logging.getLogger("loraplex.test")
    log.info("outside %s", "any request")
    with request_log_context(lambda: {"request_id": "trace-1", "tenant": "acme", "completion_id": None}):
        try:
            raise ValueError("boom")
        except ValueError:
            log.exception("failed\non two lines")
    assert all("\n" not in line for line in json_lines.lines)  # one object a line
    outside, failed = json_lines.json()
    assert set(outside) == {"ts", "level", "logger", "message"}
    assert outside["message"] == "outside any request" and outside["level"] == "INFO"
    assert outside["logger"] == "loraplex.test" and outside["ts"].endswith("Z")
    assert failed["request_id"] == "trace-1" and failed["tenant"] == "acme" and "completion_id" not in failed
    assert failed["level"] == "ERROR" and failed["message"] == "failed\non two lines"
    assert failed["exception"].startswith("Traceback") and "ValueError: boom" in failed["exception"]


def test_text_lines_end_with_the_request_fields():
    record = logging.LogRecord("loraplex.test", logging.WARNING, __file__, 1, "slow %s", ("step",), None)
    with request_log_context(lambda: {"request_id": "trace-2", "tenant": None}):
        line = TextFormatter().format(record)
    assert line.endswith(" WARNING loraplex.test: slow step request_id=trace-2")
    assert TextFormatter().format(record).endswith("loraplex.test: slow step")


def _tiny_app(**kw):
    """A Litestar app whose handler logs, and starts a task that logs, behind the platform middleware."""
    log = logging.getLogger("loraplex.test.handler")

    @get("/work")
    async def work() -> dict:
        log.info("in the handler")
        await asyncio.create_task(asyncio.sleep(0, result=None))
        await asyncio.create_task(_log_later(log))
        return {"ok": True}

    app = Litestar(route_handlers=[work], logging_config=None)
    app.asgi_handler = platform_middleware(app.asgi_handler, **kw)
    return app


async def _log_later(log: logging.Logger) -> None:
    log.warning("in a task the handler started")


def test_every_line_logged_while_handling_carries_the_clients_request_id(json_lines):
    with TestClient(_tiny_app()) as client:
        r = client.get("/work", headers={"X-Request-Id": "trace-abc.1:2"})
        assert r.headers["x-request-id"] == "trace-abc.1:2"
        handled = [line for line in json_lines.json() if line["logger"] == "loraplex.test.handler"]
        assert [line["message"] for line in handled] == ["in the handler", "in a task the handler started"]
        assert {line["request_id"] for line in handled} == {"trace-abc.1:2"}

        json_lines.lines.clear()
        for bad in ("has space", "x" * 129, "semi;colon", ""):
            r = client.get("/work", headers={"X-Request-Id": bad})
            generated = r.headers["x-request-id"]
            assert generated.startswith("req-") and generated != bad
            handled = [line for line in json_lines.json() if line["logger"] == "loraplex.test.handler"]
            assert {line["request_id"] for line in handled} == {generated}
            json_lines.lines.clear()
    logging.getLogger("loraplex.test.handler").info("after")
    assert "request_id" not in json_lines.json()[-1]


@pytest.fixture
def platform(tmp_path):
    def make(**settings):
        keys: list[str] = []
        app = create_app(Settings(data_dir=str(tmp_path), **settings), start_engine=False,
                         on_bootstrap_key=keys.append)
        return app, keys

    return make


def _access(lines) -> list[dict]:
    return [line for line in lines.json() if line["logger"] == "loraplex.access"]


def test_access_log_names_the_request_never_its_key_or_query(platform, json_lines):
    app, keys = platform(access_log=True)
    with TestClient(app) as client:
        json_lines.lines.clear()
        auth = {"Authorization": f"Bearer {keys[0]}", "X-Request-Id": "trace-77"}
        assert client.get("/v1/models?api_key=sekrit-query", headers=auth).status_code == 200
        assert client.head("/admin/tenants", headers=auth).status_code == 200
        assert client.get("/nope").status_code == 404
        bad_key = "lpx-aaaaaaaaaaaa-" + "B" * 40
        assert client.get("/v1/models", headers={"Authorization": f"Bearer {bad_key}"}).status_code == 401
        assert client.get("/v1/models%0A200%20forged").status_code == 404
        assert client.get(f"/v1/models/{keys[0]}", headers=auth).status_code == 404  # a key in a path
    models, head, nope, unauthorized, forged, key_in_path = _access(json_lines)
    assert models["message"].startswith("GET /v1/models 200 ")
    assert {k: models[k] for k in ("method", "path", "status", "request_id", "tenant")} == {
        "method": "GET", "path": "/v1/models", "status": 200, "request_id": "trace-77", "tenant": "admin"}
    assert isinstance(models["duration_ms"], float) and models["duration_ms"] >= 0
    assert (head["method"], head["path"], head["status"], head["tenant"]) == ("HEAD", "/admin/tenants", 200, "admin")
    assert (nope["path"], nope["status"]) == ("/nope", 404) and "tenant" not in nope
    assert nope["request_id"].startswith("req-")
    assert unauthorized["status"] == 401 and "tenant" not in unauthorized
    assert forged["path"] == "/v1/models\\n200 forged"  # escaped: one line, no forged status
    assert key_in_path["path"] == f"/v1/models/{keys[0][:17]}[redacted]"
    server_lines = json_lines.server_lines()
    for secret in (keys[0].rsplit("-", 1)[1], bad_key.rsplit("-", 1)[1], "sekrit"):
        assert [line for line in server_lines if secret in line] == []


def test_access_log_is_off_unless_asked_for(platform, json_lines):
    app, keys = platform()
    with TestClient(app) as client:
        assert client.get("/health").status_code == 200
    assert _access(json_lines) == []


def _loraplex(tmp_path, *args: str, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")}
    return subprocess.run([sys.executable, "-m", "loraplex.cli", "--data-dir", str(tmp_path), *args],
                          env={**base, **env}, cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_log_format_from_the_environment_applies_to_every_command_and_a_bad_one_is_named(tmp_path):
    out = _loraplex(tmp_path, "db", "upgrade", LORAPLEX_LOG_FORMAT="json", LORAPLEX_MAX_LORA="8")
    assert out.returncode == 0, out.stderr
    (line,) = [json.loads(x) for x in out.stderr.splitlines()]
    assert line["level"] == "WARNING" and line["message"].startswith("ignoring LORAPLEX_MAX_LORA")
    out = _loraplex(tmp_path, "db", "upgrade", LORAPLEX_LOG_FORMAT="yaml")
    assert out.returncode == 1
    assert out.stderr.strip() == "error: log format 'yaml' is not one of text, json (--log-format / LORAPLEX_LOG_FORMAT)"
    out = _loraplex(tmp_path, "serve", "--log-format", "yaml")
    assert out.returncode == 2 and "--log-format: invalid choice: 'yaml'" in out.stderr
