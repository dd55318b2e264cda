"""N concurrent streamed completions (OUT tokens each, ignore_eos, 4 demo adapters) against a server on
127.0.0.1:8124; prints output tok/s. Usage: stream_load.py KEY N OUT LOGPROBS(0|1)."""

import asyncio
import sys
import time

import httpx

KEY, N, OUT, LP = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
async def one(client, i):
    body = {"model": f"admin/adapter-{i % 4}", "prompt": [1] + [(i * 7 + k) % 500 + 3 for k in range(32)],
            "max_tokens": OUT, "temperature": 0.0, "stream": True, "ignore_eos": True}
    if LP:
        body["logprobs"] = 0
    n = 0
    async with client.stream("POST", "http://127.0.0.1:8124/v1/completions", json=body,
                             headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                n += 1
    return n
async def main():
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=1000)) as c:
        await one(c, 0)
        t = time.perf_counter()
        chunks = await asyncio.gather(*(one(c, i) for i in range(N)))
        dt = time.perf_counter() - t
    print(f"logprobs={LP}: {N} requests x {OUT} tokens in {dt:.2f} s, {N * OUT / dt:.0f} tok/s, chunks {sum(chunks)}")
asyncio.run(main())
