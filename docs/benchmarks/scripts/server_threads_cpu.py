"""CPU seconds per thread of a running ``loraplex serve`` while it streams tokens: how much the HTTP side (the
event loop) costs per streamed token, next to the engine loop thread. Both share one GIL.

    .venv/bin/python docs/benchmarks/scripts/server_threads_cpu.py [--streams 64] [--tokens 128] [--logprobs 0]

Launches the server on the demo model (random weights, CPU), sends ``--streams`` streaming completions at once,
and reads each thread's user + system time from /proc before and after (Linux only).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path


def thread_cpu(pid: int) -> dict[str, float]:
    """Thread name -> CPU seconds (user + system), summed over threads of the same name."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except FileNotFoundError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


async def stream_all(url: str, key: str, model: str, streams: int, tokens: int, logprobs: int | None) -> int:
    import httpx

    body = {"model": model, "prompt": [1, 5, 9, 13, 17, 21, 25, 29], "max_tokens": tokens, "temperature": 0.0,
            "stream": True, "ignore_eos": True}
    if logprobs is not None:
        body["logprobs"] = logprobs
    chunks = 0

    async def one(client) -> None:
        nonlocal chunks
        async with client.stream("POST", url + "/v1/completions", json=body,
                                 headers={"Authorization": f"Bearer {key}"}) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    chunks += 1

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await asyncio.gather(*(one(client) for _ in range(streams)))
    return chunks


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--logprobs", type=int, default=None, help="ask for logprobs (the online bench asks for 0)")
    p.add_argument("--loop-torch-threads", type=int, default=1,
                   help="LORAPLEX_LOOP_TORCH_THREADS: 1 keeps the CPU model's compute on the loop thread itself, so "
                        "the other threads' CPU is the HTTP side's")
    args = p.parse_args()
    from loraplex.bench.server_launch import launch_server
    from loraplex.demo import DemoModelSpec, build_demo_model

    model_dir = Path("/tmp/loraplex-threads-cpu/model")
    if not (model_dir / "config.json").exists():
        build_demo_model(model_dir, DemoModelSpec(arch="llama", adapters=0, seed=1))
    server = launch_server(model_dir, ["--device", "cpu", "--max-num-seqs", str(max(args.streams, 8))],
                           env={"LORAPLEX_LOOP_TORCH_THREADS": str(args.loop_torch_threads)})
    try:
        model = server.base_model()
        asyncio.run(stream_all(server.base_url, server.admin_key, model, 4, 4, args.logprobs))  # warm-up
        before, t0 = thread_cpu(server.proc.pid), time.perf_counter()
        chunks = asyncio.run(stream_all(server.base_url, server.admin_key, model, args.streams, args.tokens,
                                        args.logprobs))
        wall, after = time.perf_counter() - t0, thread_cpu(server.proc.pid)
    finally:
        server.stop()
    used = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in after}
    used = {k: v for k, v in sorted(used.items(), key=lambda kv: -kv[1]) if v > 0}
    print(json.dumps({"streams": args.streams, "loop_torch_threads": args.loop_torch_threads, "tokens_per_stream": args.tokens, "logprobs": args.logprobs,
                      "chunks": chunks, "wall_s": round(wall, 2), "chunks_per_s": round(chunks / wall, 1),
                      "thread_cpu_s": {k: round(v, 3) for k, v in used.items()},
                      "cpu_us_per_chunk": {k: round(1e6 * v / max(chunks, 1), 1) for k, v in used.items()}}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
