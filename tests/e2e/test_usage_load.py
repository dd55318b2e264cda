"""Metering under load against a live server (PostgreSQL + Redis): 1,000 concurrent requests of every
kind (non-streaming, streaming, aborted mid-stream, invalid; 900 start at once, two groups of 50 are
staged at the export cuts), exports taken while they run, and the export totals compared with what the
clients actually received, per tenant and per adapter."""

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
EARLY_DONE_AT_FIRST_CUT = 250  # the first window cut: after this many of the unstaged requests are done
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
    """Run the requests concurrently and take two window exports while they run.

    Most requests start at once. Two small groups are staged so that every window provably has requests
    ending in it, whatever the client's lag behind the server on a 2-core machine: group A starts at the
    first cut, the second cut is taken once group A is done, and group B starts at the second cut. Each
    export runs while other requests are still in flight."""
    rng = random.Random(7)
    # no keep-alive: a staged request must not pick a pooled connection the server is just closing as idle
    limits = httpx.Limits(max_connections=NUM_REQUESTS, max_keepalive_connections=0)
    first_cut, second_cut = asyncio.Event(), asyncio.Event()
    num_staged = {g: sum(1 for i in range(len(plan)) if _group(i) == g) for g in ("a", "b")}
    done = {"early": 0, "a": 0, "b": 0}
    async with httpx.AsyncClient(base_url=server.base_url, timeout=300, limits=limits) as client:
        async def one(i, kind, tenant, key, model):
            group = _group(i)
            if group == "a":
                await first_cut.wait()
            elif group == "b":
                await second_cut.wait()
            try:
                return await run_one(client, server.base_url, kind, tenant, key, model,
                                     random.Random(rng.random()), MAX_TOKENS)
            finally:
                done[group] += 1

        async def export(start: datetime, end: datetime, done_at_cut: int):
            r = await client.get("/admin/usage/export", headers={"Authorization": f"Bearer {server.admin_key}"},
                                 params={"format": "jsonl", "group_by": "adapter", "from": _iso(start), "to": _iso(end)})
            assert r.status_code == 200 and r.headers["x-usage-complete"] == "true", r.text
            return r.text, done_at_cut

        async def cut_and_export(event: asyncio.Event) -> asyncio.Task:
            cut = datetime.now(timezone.utc)
            task = asyncio.create_task(export(cuts[-1], cut, sum(done.values())))
            cuts.append(cut)
            event.set()
            return task

        async def exporter():
            while done["early"] < EARLY_DONE_AT_FIRST_CUT:
                await asyncio.sleep(0.02)
            first = await cut_and_export(first_cut)
            while done["a"] < num_staged["a"]:
                await asyncio.sleep(0.02)
            second = await cut_and_export(second_cut)
            windows.extend(await asyncio.gather(first, second))

        tasks = [one(i, *p) for i, p in enumerate(plan)]
        results, _ = await asyncio.gather(asyncio.gather(*tasks), exporter())
    return results


def _typed(row: dict) -> str:
    """The model the clients typed: the base model, or the bare name of their own adapter (an adapter's row
    carries its canonical ``<owner>/<name>@<version>``)."""
    return row["adapter_name"].split("/", 1)[1] if row["adapter_id"] else row["model"]


def _group(i: int) -> str:
    return {9: "a", 19: "b"}.get(i % 20, "early")


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
    # a client that cut its stream is done before the server has accounted for it (the abort's final delta
    # comes with the next engine step): the totals below are taken once no request is left in flight
    server.wait_none_in_flight()

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
    got = sums(by_adapter, lambda r: (r["tenant"], _typed(r)))
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
        for key, c in sums(rows, lambda r: (r["tenant"], _typed(r))).items():
            combined.update({(key, f): v for f, v in c.items()})
    assert combined == Counter({(k, f): v for k, c in expected.items() for f, v in c.items()})
    sizes = [sum(r["requests"] for r in rows) for rows in pieces]
    assert min(sizes) > 0, (sizes, [n for _, n in windows])

    # tenants see their own usage only, with the same numbers
    key, _ = tenants["acme"]
    mine = server.client(key).get("/v1/usage", params={"group_by": "adapter", "from": _iso(start)}).json()
    assert {r["tenant"] for r in mine["data"]} == {"acme"}
    assert mine["totals"]["completion_tokens"] == per_tenant["acme"]["completion_tokens"]
    print(f"\n{NUM_REQUESTS} requests in {elapsed:.1f}s; {kinds}")
