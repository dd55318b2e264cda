"""SIGKILL mid-load on the embedded default (SQLite + local spool), restart on the same data dir: every
request whose client saw the end of its response is in the ledger with exactly the tokens the client
received, none twice, and events still spooled at the kill are replayed at the restart."""

from __future__ import annotations

import asyncio
import json
import random
import sqlite3
import time

import httpx

from tests.e2e.server import start_server
from tests.e2e.usage_client import run_one

NUM_REQUESTS = 200
KILL_AFTER = 70
# every tenth request is a long stream, still generating when the kill lands: the client on 2 cores lags
# the server, which otherwise could finish every short request before the client counted KILL_AFTER
LONG_EVERY, LONG_TOKENS = 10, 200
SERVER_ENV = {
    "LORAPLEX_MAX_CONCURRENT_REQUESTS": "2000", "LORAPLEX_DEFAULT_REQUESTS_PER_MINUTE": "1000000",
    "LORAPLEX_DEFAULT_TOKENS_PER_MINUTE": "1000000000", "LORAPLEX_LOG_LEVEL": "WARNING",
    "LORAPLEX_NUM_KV_BLOCKS": "2048", "LORAPLEX_MAX_MODEL_LEN": "256", "LORAPLEX_SERVER_SECRET": "usage-crash",
}


async def _load_then_kill(server, key: str, model: str):
    finished = 0
    limits = httpx.Limits(max_connections=NUM_REQUESTS)
    async with httpx.AsyncClient(base_url=server.base_url, timeout=120, limits=limits) as client:
        async def one(i: int):
            nonlocal finished
            long = i % LONG_EVERY == 0
            kind = "stream" if long else ("nonstream", "stream")[i % 2]
            try:
                o = await run_one(client, server.base_url, kind, "acme", key, model, random.Random(i),
                                  LONG_TOKENS if long else 4)
            except (httpx.HTTPError, OSError, asyncio.IncompleteReadError, ValueError):
                return None  # cut by the kill
            if o.finished:
                finished += 1
                if finished == KILL_AFTER:
                    server.proc.kill()  # SIGKILL: no drain, no shutdown hooks
            return o

        return await asyncio.gather(*(one(i) for i in range(NUM_REQUESTS)))


def _spooled(data_dir) -> set[str]:
    ids = set()
    for segment in (data_dir / "usage-spool").glob("*/seg-*.jsonl"):
        for line in segment.read_bytes().split(b"\n"):
            try:
                ids.add(json.loads(line)["request_id"])
            except ValueError:
                pass  # a torn line: never acknowledged
    return ids


def test_sigkill_mid_load_loses_no_finished_request_and_counts_none_twice(tmp_path, tiny_model):
    data_dir = tmp_path / "data"
    srv = start_server(data_dir, model=tiny_model["model_dir"], env=SERVER_ENV)
    try:
        tenant = srv.create_tenant("acme")
        model = srv.client(tenant["key"]).get("/v1/models").json()["data"][0]["id"]
        outcomes = asyncio.run(_load_then_kill(srv, tenant["key"], model))
        assert srv.proc.wait(timeout=30) == -9
    finally:
        if srv.alive:
            srv.proc.kill()
    finished = {o.request_id: o for o in outcomes if o is not None and o.finished}
    assert KILL_AFTER <= len(finished) < NUM_REQUESTS, "the kill did not land mid-load"
    spooled = _spooled(data_dir)

    t0 = time.monotonic()
    srv = start_server(data_dir, model=tiny_model["model_dir"], env=SERVER_ENV, admin_key=srv.admin_key)
    try:
        restart_s = time.monotonic() - t0
        with sqlite3.connect(data_dir / "loraplex.db") as db:
            rows = {r[0]: r[1:] for r in db.execute(
                "SELECT request_id, prompt_tokens, cached_prompt_tokens, completion_tokens, status FROM usage_records")}
        missing = [rid for rid in finished if rid not in rows]
        assert not missing, f"{len(missing)} finished requests missing from the ledger"
        for rid, o in finished.items():
            prompt, cached, completion, status = rows[rid]
            assert (prompt, completion, status) == (o.prompt_tokens, o.completion_tokens, "completed"), rid
            if o.kind == "nonstream" or o.cached_tokens:
                assert cached == o.cached_tokens
        assert spooled <= set(rows), "events spooled at the kill were not replayed"
        # the export counts each ledger row once
        with srv.client() as c:
            lines = c.get("/admin/usage/export", params={"format": "jsonl", "group_by": "key",
                                                          "from": "2000-01-01", "to": "2100-01-01"}).text.splitlines()
        exported = [json.loads(x) for x in lines if x]
        assert sum(r["requests"] for r in exported) == len(rows)
        assert sum(r["completion_tokens"] for r in exported) == sum(r[2] for r in rows.values())
        print(f"\nfinished before the kill: {len(finished)}; ledger rows after restart: {len(rows)}; "
              f"spooled at the kill and replayed: {len(spooled)}; restart {restart_s:.1f}s")
    finally:
        assert srv.stop() == 0
