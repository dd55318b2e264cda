"""The usage routes in-process on the embedded default: plan administration with clear 4xx errors,
admin-only exports, tenants seeing only their own usage, quotas refusing with insufficient_quota before
the engine, and the CLI export matching the HTTP one."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.integration.usage_app import usage_app


async def test_plan_admin_validation_and_access(tmp_path):
    async with usage_app(tmp_path) as ua:
        c, admin = ua.client, ua.headers()
        acme = await ua.tenant("acme", scopes=("inference", "adapters:write"))
        # an inference key never reaches billing administration or exports
        for method, path in (("GET", "/admin/plans"), ("POST", "/admin/plans"), ("GET", "/admin/usage/export"),
                             ("PUT", "/admin/tenant-plans/acme")):
            r = await c.request(method, path, headers=ua.headers(acme["key"]), json={})
            assert r.status_code == 403, (path, r.text)
        assert (await c.get("/admin/plans")).status_code == 401

        bad = [
            ({"name": "Bad Name"}, "name"),
            ({"name": "p", "input_per_mtok": "-1"}, "input_per_mtok"),
            ({"name": "p", "output_per_mtok": "abc"}, "output_per_mtok"),
            ({"name": "p", "cached_input_per_mtok": "0.0000000001"}, "cached_input_per_mtok"),
            ({"name": "p", "currency": "dollars"}, "currency"),
            ({"name": "p", "monthly_token_quota": -5}, "monthly_token_quota"),
            ({"name": "p", "adapter_surcharges": {"a": "NaN"}}, "adapter_surcharges[a]"),
        ]
        for body, param in bad:
            r = await c.post("/admin/plans", json=body, headers=admin)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
        r = await c.post("/admin/plans", json={"name": "pro", "input_per_mtok": 0.1, "output_per_mtok": "0.30"},
                         headers=admin)
        assert r.status_code == 201 and r.json()["input_per_mtok"] == "0.1" and r.json()["output_per_mtok"] == "0.3"
        assert (await c.post("/admin/plans", json={"name": "pro"}, headers=admin)).status_code == 409
        r = await c.patch("/admin/plans/pro", json={"monthly_token_quota": 1000, "adapter_surcharges": {"*": "1"}},
                          headers=admin)
        assert r.status_code == 200 and r.json()["monthly_token_quota"] == 1000 and r.json()["input_per_mtok"] == "0.1"
        assert (await c.get("/admin/plans/nope", headers=admin)).status_code == 404
        assert (await c.put("/admin/tenant-plans/nobody", json={"plan": "pro"}, headers=admin)).status_code == 404
        assert (await c.put("/admin/tenant-plans/acme", json={"plan": "nope"}, headers=admin)).status_code == 404
        r = await c.put("/admin/tenant-plans/acme", json={"plan": "pro", "tenant_id": "x", "quota": 1}, headers=admin)
        assert r.status_code == 200 and r.json()["plan"]["name"] == "pro"
        assert r.json()["quota"] == {**r.json()["quota"], "monthly_token_quota": 1000, "used_tokens": 0}
        assert (await c.delete("/admin/plans/pro", headers=admin)).status_code == 409  # in use
        r = await c.put("/admin/tenant-plans/acme", json={"plan": None}, headers=admin)
        assert r.json()["plan"] is None and r.json()["quota"]["monthly_token_quota"] is None
        assert (await c.delete("/admin/plans/pro", headers=admin)).status_code == 204
        # a tenant's own quota override: taking the plan away drops it too (no plan: free and unlimited), unless
        # the same request sets one
        r = await c.put("/admin/tenant-plans/acme", json={"monthly_token_quota": 0}, headers=admin)
        assert r.json()["quota"]["monthly_token_quota"] == 0
        r = await c.put("/admin/tenant-plans/acme", json={"plan": None}, headers=admin)
        assert r.json()["quota"]["monthly_token_quota"] is None, r.text
        r = await c.put("/admin/tenant-plans/acme", json={"plan": None, "monthly_token_quota": 7}, headers=admin)
        assert r.json()["quota"]["monthly_token_quota"] == 7
        await c.put("/admin/tenant-plans/acme", json={"plan": None}, headers=admin)

        for params, param in (({"group_by": "week"}, "group_by"), ({"format": "xml"}, "format"),
                              ({"from": "yesterday"}, "from"), ({"from": "2026-02-01", "to": "2026-01-01"}, "to")):
            r = await c.get("/admin/usage/export", params=params, headers=admin)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (params, r.text)
            r = await c.get("/v1/usage", params=params, headers=ua.headers(acme["key"]))
            assert r.status_code == 400 or "format" in params
        assert (await c.get("/admin/usage/export", params={"tenant": "nobody"}, headers=admin)).status_code == 404
        assert (await c.get("/v1/usage")).status_code == 401


async def test_quota_usage_views_and_cli_export(tmp_path, tiny_model):
    async with usage_app(tmp_path, model=tiny_model["model_dir"], max_model_len=256, num_kv_blocks=256) as ua:
        c, admin = ua.client, ua.headers()
        acme, globex = await ua.tenant("acme"), await ua.tenant("globex")
        model = (await c.get("/v1/models", headers=ua.headers(acme["key"]))).json()["data"][0]["id"]
        await c.post("/admin/plans", json={"name": "tiny", "input_per_mtok": "1", "output_per_mtok": "2",
                                           "monthly_token_quota": 30}, headers=admin)
        await c.put("/admin/tenant-plans/acme", json={"plan": "tiny"}, headers=admin)

        async def complete(key, max_tokens):
            return await c.post("/v1/completions", headers=ua.headers(key), json={
                "model": model, "prompt": [5, 6, 7, 8, 9], "max_tokens": max_tokens, "ignore_eos": True})

        assert (await complete(acme["key"], 5)).status_code == 200  # 10 of 30
        assert (await complete(acme["key"], 5)).status_code == 200  # 20 of 30
        r = await complete(acme["key"], 6)  # could reach 31: refused before the engine
        assert r.status_code == 429 and r.json()["error"]["code"] == "insufficient_quota"
        assert r.json()["error"]["type"] == "insufficient_quota" and r.headers["x-should-retry"] == "false"
        assert (await complete(acme["key"], 5)).status_code == 200  # exactly 30: allowed
        r = await complete(acme["key"], 1)
        assert r.status_code == 429 and "exceeded your monthly token quota" in r.json()["error"]["message"]
        assert (await complete(globex["key"], 5)).status_code == 200  # other tenants are unaffected

        mine = (await c.get("/v1/usage", params={"group_by": "key"}, headers=ua.headers(acme["key"]))).json()
        assert mine["complete"] is True and [r["tenant"] for r in mine["data"]] == ["acme"]
        assert mine["totals"]["requests"] == 3 and mine["totals"]["total_tokens"] == 30
        assert mine["totals"]["cost"] == {"USD": "0.000045"}  # 15 x 1 + 15 x 2 per million
        assert mine["quota"]["remaining_tokens"] == 0 and mine["quota"]["used_tokens"] == 30
        theirs = (await c.get("/v1/usage", headers=ua.headers(globex["key"]))).json()
        assert theirs["totals"]["requests"] == 1 and theirs["quota"]["monthly_token_quota"] is None

        r = await c.get("/admin/usage/export", params={"group_by": "key", "format": "csv"}, headers=admin)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/csv")
        http_csv = r.text
        assert http_csv.splitlines()[0].startswith("tenant_id,tenant,key_id,requests")
        r = await c.get("/admin/usage/export", params={"tenant": "acme", "format": "jsonl"}, headers=admin)
        (row,) = [json.loads(x) for x in r.text.splitlines()]
        assert (row["tenant"], row["requests"], row["cost"]) == ("acme", 3, "0.000045")

    # the CLI reads the same database directly (server stopped: nothing is left in the spool)
    env = {"LORAPLEX_DATA_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-m", "loraplex.cli", "usage", "export", "--group-by", "key",
                          "--format", "csv"], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout == http_csv
    bad = subprocess.run([sys.executable, "-m", "loraplex.cli", "usage", "export", "--from", "nope"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "from must be an ISO 8601" in bad.stderr


@pytest.mark.parametrize("fmt", ["csv", "jsonl"])
async def test_empty_export_is_well_formed(tmp_path, fmt):
    async with usage_app(tmp_path) as ua:
        r = await ua.client.get("/admin/usage/export", params={"format": fmt}, headers=ua.headers())
        assert r.status_code == 200 and r.headers["x-usage-complete"] == "true"
        assert r.text == ("tenant_id,tenant,day,requests,completed,aborted,errors,prompt_tokens,cached_prompt_tokens,"
                          "completion_tokens,total_tokens,currency,cost\n" if fmt == "csv" else "")


async def test_cli_replay_moves_a_stopped_servers_spool_into_the_ledger(tmp_path):
    from tests.unit.usage.ledger_env import event

    async with usage_app(tmp_path) as ua:
        acme = await ua.tenant("acme")
    # a server that died with events still spooled (its lock is gone, its segments are not)
    from loraplex.platform.usage.sink import LedgerSink

    sink = LedgerSink(None, tmp_path / "usage-spool")
    sink.spool.open()
    for i in range(3):
        await sink.record(event(f"cli-{i}", acme["id"], completion=i + 1))
    await sink.record(event("cli-0", acme["id"], completion=1))  # delivered twice
    sink.spool.close()
    env = {"LORAPLEX_DATA_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}
    for expected in ("3 usage record(s)", "0 usage record(s)"):  # a second replay finds nothing new
        out = subprocess.run([sys.executable, "-m", "loraplex.cli", "usage", "replay"], env=env,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and expected in out.stdout, out.stdout + out.stderr
    out = subprocess.run([sys.executable, "-m", "loraplex.cli", "usage", "export", "--format", "jsonl",
                          "--tenant", "acme", "--from", "2000-01-01", "--to", "2100-01-01"], env=env,
                         capture_output=True, text=True, timeout=120)
    (row,) = [json.loads(x) for x in out.stdout.splitlines()]
    assert (row["requests"], row["completion_tokens"]) == (3, 6)


@pytest.fixture
def fresh_pg(postgres_url):
    from tests.e2e.server import FreshPostgres

    with FreshPostgres(postgres_url) as url:
        yield url


async def test_plan_change_reaches_another_replica_at_once(tmp_path, fresh_pg, redis_url):
    """Replica b caches acme's quota; an admin change on replica a reaches b through Redis pub/sub
    well before b's cache (5 s) would expire."""
    import asyncio

    async with usage_app(tmp_path / "a", database_url=fresh_pg, redis_url=redis_url) as a, \
            usage_app(tmp_path / "b", database_url=fresh_pg, redis_url=redis_url) as b:
        await a.tenant("acme")
        admin = a.headers()
        assert (await a.client.post("/admin/plans", json={"name": "p", "monthly_token_quota": 1000},
                                    headers=admin)).status_code == 201
        await a.client.put("/admin/tenant-plans/acme", json={"plan": "p"}, headers=admin)

        async def quota_seen_by_b():
            r = await b.client.get("/admin/tenant-plans/acme", headers=admin)
            return r.json()["quota"]["monthly_token_quota"]

        assert await quota_seen_by_b() == 1000  # now cached on b
        r = await a.client.put("/admin/tenant-plans/acme", json={"monthly_token_quota": 5}, headers=admin)
        assert r.json()["quota"]["monthly_token_quota"] == 5
        changed_at = asyncio.get_running_loop().time()
        while await quota_seen_by_b() != 5:
            assert asyncio.get_running_loop().time() - changed_at < 2.0, "b kept its cached quota"
            await asyncio.sleep(0.02)


async def test_plan_surcharges_name_adapters_that_exist(tmp_path):
    """``adapter_surcharges`` keys are "*", an adapter id or ``<tenant>/<adapter>`` of an adapter the registry
    knows; anything else (the docs' literal "<adapter_id>", a typo) is a 400 naming the field and the key."""
    from loraplex.platform.db import make_engine, make_session_factory, utcnow
    from loraplex.platform.registry.models import Adapter

    async with usage_app(tmp_path) as ua:
        c, admin = ua.client, ua.headers()
        acme = await ua.tenant("acme")
        db = make_engine(ua.services.settings.effective_database_url)
        async with make_session_factory(db)() as s:
            s.add(Adapter(id="a" * 32, tenant_id=acme["id"], name="bot", created_at=utcnow(), updated_at=utcnow()))
            s.add(Adapter(id="b" * 32, tenant_id=acme["id"], name="old", created_at=utcnow(), updated_at=utcnow(),
                          deleted_at=utcnow()))
            await s.commit()
        await db.dispose()
        for body in ({"name": "p", "adapter_surcharges": {"*": "0.02", "<adapter_id>": "0.10"}},
                     {"name": "p", "adapter_surcharges": {"acme/nope": "1"}},
                     {"name": "p", "adapter_surcharges": {"globex/bot": "1"}}):
            r = await c.post("/admin/plans", json=body, headers=admin)
            bad = next(k for k in body["adapter_surcharges"] if k != "*")
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "adapter_surcharges" and repr(bad) in r.json()["error"]["message"]
        assert (await c.get("/admin/plans/p", headers=admin)).status_code == 404  # nothing half-created
        # an id, or the canonical name (stored as the id); a deleted adapter still prices its past usage
        r = await c.post("/admin/plans", json={"name": "p", "adapter_surcharges": {"*": "0.02", "acme/bot": "0.1",
                                                                                   "b" * 32: "0.3"}}, headers=admin)
        assert r.status_code == 201, r.text
        assert r.json()["adapter_surcharges"] == {"*": "0.02", "a" * 32: "0.1", "b" * 32: "0.3"}
        r = await c.patch("/admin/plans/p", json={"adapter_surcharges": {"a" * 32: "0.2", "acme/typo": "1"}},
                          headers=admin)
        assert r.status_code == 400 and "'acme/typo'" in r.json()["error"]["message"]
        r = await c.patch("/admin/plans/p", json={"adapter_surcharges": {"a" * 32: "0.2", "acme/bot": "1"}},
                          headers=admin)
        assert r.status_code == 400 and r.json()["error"]["param"] == "adapter_surcharges"  # one adapter twice
        assert (await c.get("/admin/plans/p", headers=admin)).json()["adapter_surcharges"]["a" * 32] == "0.1"


async def test_a_request_without_max_tokens_is_cut_to_what_the_quota_has_left(tmp_path, tiny_model):
    """Without max_tokens a chat's budget is the server's default (the rest of the context), which it never
    asked for: near its quota a small request runs, cut to what is left, instead of a 429 for that worst case;
    the quota still holds exactly. An explicit max_tokens is never cut."""
    async with usage_app(tmp_path, model=tiny_model["model_dir"], max_model_len=256, num_kv_blocks=256) as ua:
        c, admin = ua.client, ua.headers()
        acme = await ua.tenant("acme")
        model = (await c.get("/v1/models", headers=ua.headers(acme["key"]))).json()["data"][0]["id"]
        await c.post("/admin/plans", json={"name": "small", "monthly_token_quota": 60}, headers=admin)
        await c.put("/admin/tenant-plans/acme", json={"plan": "small"}, headers=admin)
        chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}

        async def ask(**extra):
            return await c.post("/v1/chat/completions", json={**chat, **extra}, headers=ua.headers(acme["key"]))

        r = await ask()  # would reserve prompt + 256 - prompt before: refused with 60 tokens left
        assert r.status_code == 200, r.text
        usage, prompt = r.json()["usage"], r.json()["usage"]["prompt_tokens"]
        assert usage["total_tokens"] == 60 and r.json()["choices"][0]["finish_reason"] == "length", usage
        r = await ask()
        assert r.status_code == 429 and "exceeded your monthly token quota" in r.json()["error"]["message"]

        async def left(tokens):  # a quota override leaving exactly ``tokens``
            r = await c.put("/admin/tenant-plans/acme", json={"monthly_token_quota": 60 + tokens}, headers=admin)
            assert r.status_code == 200, r.text

        await left(prompt)  # the prompt fits, no completion token does
        r = await ask()
        assert r.status_code == 429 and r.json()["error"]["code"] == "insufficient_quota"
        message = r.json()["error"]["message"]
        assert f"at least {prompt + 1} tokens" in message and "without max_tokens" in message, message
        assert f"only {prompt} of the monthly quota" in message, message
        await left(prompt + 5)
        r = await ask(max_tokens=6)  # a budget the client set is a promise: refused, not cut
        assert r.status_code == 429 and "prompt + max_tokens x n" in r.json()["error"]["message"]
        r = await ask(n=2)  # two choices share what is left: 2 tokens each
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
        assert [ch["finish_reason"] for ch in r.json()["choices"]] == ["length", "length"]
        mine = (await c.get("/v1/usage", headers=ua.headers(acme["key"]))).json()
        assert mine["quota"]["used_tokens"] == 60 + prompt + 4 <= mine["quota"]["monthly_token_quota"]
