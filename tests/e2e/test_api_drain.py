"""The embedded default from scratch (demo model generated on first run) and a SIGTERM drain under load:
20 streaming requests in flight all finish, new requests are refused, the process exits 0."""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import openai

from tests.e2e.server import start_server

NUM_STREAMS = 20
MAX_TOKENS = 32


async def _stream(client: openai.AsyncOpenAI, model: str, first_token: asyncio.Event) -> dict:
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Count slowly"}], max_tokens=MAX_TOKENS, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )
    finish, usage = None, None
    async for chunk in stream:
        if chunk.choices:
            if chunk.choices[0].delta.content:
                first_token.set()
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage
    return {"finish": finish, "usage": usage}


async def test_first_run_default_and_sigterm_drain(tmp_path):
    srv = start_server(tmp_path, env={"LORAPLEX_NUM_KV_BLOCKS": "512", "LORAPLEX_DRAIN_TIMEOUT_S": "120"})
    try:
        # first run of the no-argument default: demo model + adapters generated in the data dir
        assert (tmp_path / "demo-model" / "loraplex_demo.json").is_file()
        assert (tmp_path / "loraplex.db").is_file()
        tenant = srv.create_tenant("drainer")
        client = openai.AsyncOpenAI(api_key=tenant["key"], base_url=srv.base_url + "/v1", max_retries=0,
                                    timeout=120)
        model = (await client.models.list()).data[0].id
        first_tokens = [asyncio.Event() for _ in range(NUM_STREAMS)]
        tasks = [asyncio.create_task(_stream(client, model, ev)) for ev in first_tokens]
        # every stream is mid-generation (has tokens, needs more) when the signal comes
        await asyncio.wait_for(asyncio.gather(*(ev.wait() for ev in first_tokens)), 60)

        srv.proc.send_signal(signal.SIGTERM)
        refused = False
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not refused:
            try:
                r = httpx.post(srv.base_url + "/v1/chat/completions", timeout=5,
                               headers={"Authorization": f"Bearer {tenant['key']}"},
                               json={"model": model, "messages": [{"role": "user", "content": "late"}]})
                refused = r.status_code == 503
            except httpx.TransportError:
                refused = True  # the listening socket is closed
            await asyncio.sleep(0.05)
        assert refused, "a new request was still accepted after SIGTERM"

        results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
        assert len(results) == NUM_STREAMS
        for r in results:
            assert r["finish"] == "length" and r["usage"].completion_tokens == MAX_TOKENS
        assert await asyncio.to_thread(srv.proc.wait, 60) == 0
    finally:
        srv.stop()
