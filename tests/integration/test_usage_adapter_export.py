"""Exports grouped by adapter, on SQLite and PostgreSQL: one row per adapter version however callers spelled
the model, the same totals as any other grouping, and nothing of another tenant in a tenant's rows.
HTTP (``/admin/usage/export``, ``/v1/usage``) and ``loraplex usage export`` give the same rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from datetime import datetime, timezone

import pytest

from loraplex.platform.db import make_engine, make_session_factory, utcnow
from loraplex.platform.registry.models import Adapter
from loraplex.platform.usage.ledger import event_record, insert_records
from tests.conftest import ROOT
from tests.integration.usage_app import usage_app
from tests.unit.usage.ledger_env import event

AT = datetime(2026, 4, 2, 12, tzinfo=timezone.utc)
WINDOW = {"from": "2026-04-01", "to": "2026-05-01"}


@pytest.fixture(params=["sqlite", "postgres"])
def database_url(request):
    if request.param == "sqlite":
        yield None  # the embedded default: <data_dir>/loraplex.db
        return
    from tests.e2e.server import FreshPostgres

    with FreshPostgres(request.getfixturevalue("postgres_url")) as url:
        yield url


def _used(rid, tenant, model, adapter=None, version=1, name=None, prompt=10, completion=5):
    ev = replace(event(rid, tenant["id"], prompt=prompt, completion=completion, at=AT, adapter_id=adapter,
                       key_id=tenant["key_id"]), tenant_name=tenant["name"], model=model,
                 adapter_version=version if adapter else None, adapter_name=name)
    return event_record(ev)


async def test_adapter_export_groups_by_identity_not_spelling(tmp_path, database_url):
    async with usage_app(tmp_path, database_url=database_url) as ua:
        c = ua.client
        admin = {"id": None, "name": "admin", "key_id": "adminkey"}
        acme, globex = await ua.tenant("acme"), await ua.tenant("globex")
        admin["id"] = (await c.get("/admin/tenants", headers=ua.headers())).json()["data"][0]["id"]
        # the app's client runs the app on a loop of its own: this test writes through its own engine
        db = make_engine(ua.services.settings.effective_database_url)
        sessions = make_session_factory(db)
        async with sessions() as s:
            for aid, owner, name in (("a0", admin, "adapter-0"), ("old", admin, "old"), ("g1", globex, "secret")):
                s.add(Adapter(id=aid, tenant_id=owner["id"], name=name, visibility="public", created_at=utcnow(),
                              updated_at=utcnow()))
            await s.commit()
        records = [
            # the admin tenant calls its own public adapter three ways: one adapter, one row
            _used("r1", admin, "adapter-0", "a0", name="admin/adapter-0", completion=1),
            _used("r2", admin, "admin/adapter-0", "a0", name="admin/adapter-0", completion=2),
            _used("r3", admin, "adapter-0@1", "a0", name="admin/adapter-0", completion=4),
            _used("r4", admin, "adapter-0@2", "a0", version=2, name="admin/adapter-0", completion=8),
            # rows written without adapter_name (older writers): the name of their adapter's other rows,
            # else the registry's, else the id itself; never dropped, never counted twice
            _used("r5", admin, "adapter-0", "a0", completion=16),
            _used("r6", admin, "old", "old", completion=32),
            _used("r7", admin, "gone", "deadbeef", completion=64),
            _used("r8", admin, "base-model", completion=128),
            _used("r9", acme, "admin/adapter-0", "a0", name="admin/adapter-0", completion=256),
            _used("r10", acme, "admin/adapter-0@1", "a0", name="admin/adapter-0", completion=512),
            _used("r11", globex, "secret", "g1", name="globex/secret", completion=1024),
            _used("r12", globex, "admin/adapter-0", "a0", name="admin/adapter-0", completion=2048),
        ]
        assert len(await insert_records(sessions, records)) == len(records)
        await db.dispose()

        r = await c.get("/admin/usage/export", params={**WINDOW, "group_by": "adapter", "format": "jsonl"},
                        headers=ua.headers())
        assert r.status_code == 200
        http_jsonl = r.text
        rows = [json.loads(x) for x in http_jsonl.splitlines()]
        got = {(x["tenant"], x["model"], x["adapter_id"], x["adapter_name"], x["adapter_version"]):
               (x["requests"], x["completion_tokens"]) for x in rows}
        assert got == {
            ("admin", "admin/adapter-0@1", "a0", "admin/adapter-0", 1): (4, 1 + 2 + 4 + 16),
            ("admin", "admin/adapter-0@2", "a0", "admin/adapter-0", 2): (1, 8),
            ("admin", "admin/old@1", "old", "admin/old", 1): (1, 32),
            ("admin", "deadbeef@1", "deadbeef", None, 1): (1, 64),
            ("admin", "base-model", None, None, None): (1, 128),
            ("acme", "admin/adapter-0@1", "a0", "admin/adapter-0", 1): (2, 256 + 512),
            ("globex", "globex/secret@1", "g1", "globex/secret", 1): (1, 1024),
            ("globex", "admin/adapter-0@1", "a0", "admin/adapter-0", 1): (1, 2048),
        }
        by_day = (await c.get("/admin/usage/export", params={**WINDOW, "group_by": "day", "format": "jsonl"},
                              headers=ua.headers())).text
        assert sum(json.loads(x)["total_tokens"] for x in by_day.splitlines()) == \
            sum(x["total_tokens"] for x in rows) == 12 * 10 + 4095

        # a tenant's own view: its rows only, no other tenant's adapter or spelling anywhere
        mine = await c.get("/v1/usage", params={**WINDOW, "group_by": "adapter"}, headers=ua.headers(acme["key"]))
        assert mine.status_code == 200 and "globex" not in mine.text and "secret" not in mine.text
        assert [(x["model"], x["requests"]) for x in mine.json()["data"]] == [("admin/adapter-0@1", 2)]
        r = await c.get("/admin/usage/export", params={**WINDOW, "group_by": "adapter", "tenant": "acme",
                                                        "format": "csv"}, headers=ua.headers())
        assert "globex" not in r.text and "secret" not in r.text and len(r.text.splitlines()) == 2

    # the CLI reads the same database and writes the same bytes
    env = {**os.environ, "LORAPLEX_DATA_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    env.pop("LORAPLEX_DATABASE_URL", None)
    if database_url:
        env["LORAPLEX_DATABASE_URL"] = database_url
    out = subprocess.run([sys.executable, "-m", "loraplex.cli", "usage", "export", "--group-by", "adapter",
                          "--format", "jsonl", "--from", WINDOW["from"], "--to", WINDOW["to"]],
                         env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout == http_jsonl
