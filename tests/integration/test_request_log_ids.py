"""An operator joins a client's X-Request-Id to the usage ledger through the access log: the line of a completion
carries both the request id and the completion id (the ledger's request_id), streamed or not, while no log line,
at any level, holds the prompt, the completion or the key."""

from __future__ import annotations

import json
import logging

import sqlalchemy as sa

from loraplex.platform.db import make_engine
from loraplex.platform.usage.models import UsageRecord
from tests.integration.usage_app import usage_app
from tests.log_lines import json_log_lines

PROMPT = "Quokkas juggle marmalade beneath violet lanterns"


async def _ledger_ids(db_path) -> set[str]:
    engine = make_engine(f"sqlite+aiosqlite:///{db_path}")
    try:
        async with engine.connect() as conn:
            return set((await conn.execute(sa.select(UsageRecord.request_id))).scalars())
    finally:
        await engine.dispose()


async def test_access_log_joins_request_id_to_completion_id_and_ledger(tmp_path, tiny_model):
    with json_log_lines() as lines:
        assert logging.getLogger().getEffectiveLevel() == logging.DEBUG  # every level is looked at
        async with usage_app(tmp_path, model=tiny_model["model_dir"], max_model_len=256, num_kv_blocks=64,
                             access_log=True) as ua:
            acme = await ua.tenant("acme")
            headers = ua.headers(acme["key"])
            model = (await ua.client.get("/v1/models", headers=headers)).json()["data"][0]["id"]
            r = await ua.client.post("/v1/completions", headers={**headers, "X-Request-Id": "trace-plain"}, json={
                "model": model, "prompt": PROMPT, "max_tokens": 12, "ignore_eos": True})
            assert r.status_code == 200 and r.headers["x-request-id"] == "trace-plain"
            plain_id, completion = r.json()["id"], r.json()["choices"][0]["text"]
            async with ua.client.stream("POST", "/v1/chat/completions", headers={
                    **headers, "X-Request-Id": "trace-stream"}, json={
                    "model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 12,
                    "stream": True, "ignore_eos": True}) as s:
                events = [json.loads(line[6:]) async for line in s.aiter_lines() if line.startswith("data: {")]
            stream_id = events[0]["id"]
            streamed = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])

    access = {line["request_id"]: line for line in lines.json() if line["logger"] == "loraplex.access"}
    assert access["trace-plain"]["completion_id"] == plain_id and plain_id.startswith("cmpl-")
    assert access["trace-stream"]["completion_id"] == stream_id and stream_id.startswith("chatcmpl-")
    for rid, path in (("trace-plain", "/v1/completions"), ("trace-stream", "/v1/chat/completions")):
        assert (access[rid]["path"], access[rid]["status"], access[rid]["tenant"]) == (path, 200, "acme")
    assert all("completion_id" not in line for line in access.values() if line["path"] == "/v1/models")
    assert {plain_id, stream_id} <= await _ledger_ids(tmp_path / "loraplex.db")  # the join an operator makes

    secrets = [PROMPT, "marmalade", acme["key"].rsplit("-", 1)[1]]
    secrets += [text for text in (completion, streamed) if len(text.strip()) >= 8]
    assert len(secrets) == 5, (completion, streamed)  # the completions are long enough to be looked for
    server_lines = lines.server_lines()
    for secret in secrets:
        assert [line for line in server_lines if secret in line] == [], secret
