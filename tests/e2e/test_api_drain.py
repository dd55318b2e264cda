"""SIGTERM under load, on both backends (the embedded one on its first run, generating its demo model):
20 streaming requests in flight all finish, new requests are refused, the process exits 0."""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import openai
import pytest

from tests.e2e.server import BACKENDS, backend_server

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


@pytest.fixture(params=BACKENDS)
def srv(request, tmp_path_factory):
    env = {"LORAPLEX_NUM_KV_BLOCKS": "512", "LORAPLEX_DRAIN_TIMEOUT_S": "120"}
    with backend_server(request, tmp_path_factory, request.param, env=env, first_run=True) as server:
        yield server


async def test_sigterm_drains_20_streams_and_exits_0(srv):
    if "LORAPLEX_DATABASE_URL" not in srv.env:
        # the no-argument default on its first run: demo model + adapters generated in the data dir
        assert (srv.data_dir / "demo-model" / "loraplex_demo.json").is_file()
        assert (srv.data_dir / "loraplex.db").is_file()
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
            async with httpx.AsyncClient(timeout=5) as late:  # a new connection each time
                r = await late.post(srv.base_url + "/v1/chat/completions",
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
