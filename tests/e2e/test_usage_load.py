"""Metering under load against a live server (PostgreSQL + Redis): 1,000 concurrent requests of every
kind (non-streaming, streaming, aborted mid-stream, invalid), exports taken while they run, and the
export totals compared with what the clients actually received, per tenant and per adapter."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from datetime import datetime, timedelta, timezone

import httpx
import pytest

from tests.e2e.server import FreshPostgres, start_server
from tests.e2e.usage_client import Expected, export_rows, run_one, sums, upload_adapter

NUM_REQUESTS = 1000
MAX_TOKENS = 3
KINDS = ["nonstream"] * 40 + ["stream"] * 30 + ["abort"] * 20 + ["invalid"] * 10
SERVER_ENV = {
    "LORAPLEX_MAX_CONCURRENT_REQUESTS": "4000", "LORAPLEX_DEFAULT_REQUESTS_PER_MINUTE": "1000000",
    "LORAPLEX_DEFAULT_TOKENS_PER_MINUTE": "1000000000", "LORAPLEX_LOG_LEVEL": "WARNING",
    "LORAPLEX_NUM_KV_BLOCKS": "4096", "LORAPLEX_MAX_MODEL_LEN": "256",
}


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model, postgres_url, redis_url):
    with FreshPostgres(postgres_url) as db_url:
        env = {**SERVER_ENV, "LORAPLEX_SERVER_SECRET": f"usage-load-{time.time_ns()}"}
        srv = start_server(tmp_path_factory.mktemp("usage-load"), model=tiny_model["model_dir"],
                           database_url=db_url, redis_url=redis_url, env=env)
        yield srv
        assert srv.stop() == 0


def _iso(t: datetime) -> str:
    return t.isoformat().replace("+00:00", "Z")


async def _load(server, plan: list[tuple[str, str, str, str]], cuts: list[datetime], windows: list):
    """Run every request at once; take window exports at 1/3 and 2/3 of completions, while the rest run."""
    rng = random.Random(7)
    limits = httpx.Limits(max_connections=NUM_REQUESTS, max_keepalive_connections=NUM_REQUESTS)
    done = 0
    async with httpx.AsyncClient(base_url=server.base_url, timeout=300, limits=limits) as client:
        async def one(kind, tenant, key, model):
            nonlocal done
            try:
                return await run_one(client, server.base_url, kind, tenant, key, model,
                                     random.Random(rng.random()), MAX_TOKENS)
            finally:
                done += 1

        async def exporter():
            admin = {"Authorization": f"Bearer {server.admin_key}"}
            for fraction in (1 / 3, 2 / 3):
                while done < NUM_REQUESTS * fraction:
                    await asyncio.sleep(0.05)
                cut = datetime.now(timezone.utc)
                r = await client.get("/admin/usage/export", headers=admin, params={
                    "format": "jsonl", "group_by": "adapter", "from": _iso(cuts[-1]), "to": _iso(cut)})
                assert r.status_code == 200 and r.headers["x-usage-complete"] == "true", r.text
                windows.append((r.text, done))
                cuts.append(cut)

        tasks = [one(*p) for p in plan]
        results, _ = await asyncio.gather(asyncio.gather(*tasks), exporter())
    return results


def test_thousand_concurrent_requests_export_equals_what_clients_received(server, tiny_model):
    import json

    tenants = {}
    for i, name in enumerate(("acme", "globex")):
        t = server.create_tenant(name, scopes=["inference", "adapters:write"])
        base = server.client(t["key"]).get("/v1/models").json()["data"][0]["id"]
        tenants[name] = (t["key"], [base, upload_adapter(server, t["key"], tiny_model, i, f"{name}-lora")])
    rng = random.Random(3)
    plan = []
    for i in range(NUM_REQUESTS):
        name = ("acme", "globex")[i % 2]
        key, models = tenants[name]
        plan.append((KINDS[i % len(KINDS)], name, key, rng.choice(models)))
    start = datetime.now(timezone.utc) - timedelta(seconds=1)
    cuts, windows = [start], []
    t0 = time.monotonic()
    outcomes = asyncio.run(_load(server, plan, cuts, windows))
    elapsed = time.monotonic() - t0

    kinds = Counter((o.kind, o.status) for o in outcomes)
    if any(o.status >= 500 for o in outcomes):
        print("\n".join(server.output[-400:]))
    assert kinds[("invalid", 400)] == NUM_REQUESTS // 10, kinds
    assert all(o.status == 200 for o in outcomes if o.kind != "invalid"), kinds
    assert sum(o.kind == "abort" and not o.finished for o in outcomes) > 0, "no stream was actually cut short"
    expected = Expected.of(outcomes)
    assert len(expected) == 4  # two tenants x (base model, own adapter)

    # the whole period, by adapter: exactly what the clients received (aborted: what was sent)
    by_adapter = export_rows(server, group_by="adapter", **{"from": _iso(start)})
    got = sums(by_adapter, lambda r: (r["tenant"], r["model"]))
    assert got == expected, (got, expected)
    assert all(r["adapter_id"] for r in by_adapter if "lora" in r["model"])
    assert all(r["adapter_id"] is None for r in by_adapter if "lora" not in r["model"])
    aborted = sum(r["aborted"] for r in by_adapter)
    cut = [o for o in outcomes if o.kind == "abort" and not o.finished]
    # a cut stream that still received every token was generated to the end: the server records its usage
    # (durably) before it sends the final usage chunk and [DONE], so it may rightly say "completed"
    short = sum(o.completion_tokens < MAX_TOKENS for o in cut)
    assert short <= aborted <= len(cut), (short, aborted, len(cut))

    # the same totals per tenant through the other groupings
    per_tenant = {t: sum((c for (tt, _), c in expected.items() if tt == t), Counter()) for t in tenants}
    for group in ("day", "key"):
        assert sums(export_rows(server, group_by=group, **{"from": _iso(start)}), lambda r: r["tenant"]) == per_tenant

    # windows exported mid-load + the rest: every request in exactly one window
    last = export_rows(server, group_by="adapter", **{"from": _iso(cuts[-1])})
    pieces = [[json.loads(line) for line in text.splitlines() if line] for text, _ in windows] + [last]
    assert all(0 < n < NUM_REQUESTS for _, n in windows), "exports were not taken during the load"
    combined = Counter()
    for rows in pieces:
        for key, c in sums(rows, lambda r: (r["tenant"], r["model"])).items():
            combined.update({(key, f): v for f, v in c.items()})
    assert combined == Counter({(k, f): v for k, c in expected.items() for f, v in c.items()})
    assert min(sum(r["requests"] for r in rows) for rows in pieces) > 0

    # tenants see their own usage only, with the same numbers
    key, _ = tenants["acme"]
    mine = server.client(key).get("/v1/usage", params={"group_by": "adapter", "from": _iso(start)}).json()
    assert {r["tenant"] for r in mine["data"]} == {"acme"}
    assert mine["totals"]["completion_tokens"] == per_tenant["acme"]["completion_tokens"]
    print(f"\n{NUM_REQUESTS} requests in {elapsed:.1f}s; {kinds}")
