"""The engine's step loop in a non-main thread (AsyncEngine, as the server runs it) against the main thread.

64 requests x 64 greedy tokens over 4 adapters on the demo model (`loraplex demo-model`), CPU. Figures: output
tok/s of ``LLM.generate`` in the main thread, the same call in a fresh thread (torch's default intra-op threads,
and 1), and ``AsyncEngine`` with ``loop_torch_threads`` 0 (torch's default) and 1, each in its own process.
Writes JSON to argv[2].

    python docs/benchmarks/scripts/engine_thread.py ~/.loraplex/demo-model out.json
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time

import torch

from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.config import EngineConfig
from loraplex.engine.protocol import EngineRequest

N, OUT = 64, 64


def _workload(model: str):
    names = sorted(os.listdir(f"{model}/adapters"))[:4]
    prompts = [[1] + [(i * 7 + k) % 500 + 3 for k in range(32)] for i in range(N)]
    loras = [LoRARequest(names[i % 4], i % 4 + 1, f"{model}/adapters/{names[i % 4]}") for i in range(N)]
    return prompts, loras, SamplingParams(max_tokens=OUT, temperature=0, ignore_eos=True)


def offline(model: str, where: str) -> dict:
    """``where``: "main", "thread" (torch's default intra-op threads) or "thread-1" (1 intra-op thread)."""
    prompts, loras, params = _workload(model)
    llm = LLM(model=model, enable_lora=True, max_loras=8, max_lora_rank=64)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    out: dict = {}

    def run() -> None:
        if where == "thread-1":
            torch.set_num_threads(1)
        llm.generate(inputs[:4], params, lora_request=loras[:4])  # warm-up
        start = time.perf_counter()
        llm.generate(inputs, params, lora_request=loras)
        out.update(tok_per_s=N * OUT / (time.perf_counter() - start), torch_threads=torch.get_num_threads())

    if where == "main":
        run()
    else:
        t = threading.Thread(target=run)
        t.start()
        t.join()
    return out


async def _async_engine(model: str, loop_threads: int) -> dict:
    prompts, loras, params = _workload(model)
    eng = AsyncEngine.from_config(EngineConfig(model=model, enable_lora=True, max_loras=8, max_lora_rank=64,
                                               loop_torch_threads=loop_threads))

    async def one(tag: str, i: int) -> int:
        req = EngineRequest(f"{tag}-{i}", prompts[i], params, lora_request=loras[i])
        return sum([len(d.token_ids) async for d in eng.generate(req)])

    try:
        await asyncio.gather(*(one("warm", i) for i in range(4)))
        start = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one("run", i) for i in range(N))))
        return {"tok_per_s": tokens / (time.perf_counter() - start), "loop_torch_threads_seen": eng.loop_torch_threads}
    finally:
        await eng.shutdown()


VARIANTS = ("offline main", "offline thread", "offline thread-1", "AsyncEngine 0", "AsyncEngine 1")


def main() -> None:
    model, path = sys.argv[1], sys.argv[2]
    if len(sys.argv) > 3:  # one variant, in a fresh process (torch's thread settings outlive the threads)
        kind, arg = sys.argv[3].split(" ")
        res = offline(model, arg) if kind == "offline" else asyncio.run(_async_engine(model, int(arg)))
        print(json.dumps(res))
        return
    result = {"cpus": os.cpu_count(), "torch": torch.__version__, "default_torch_threads": torch.get_num_threads(),
              "requests": N, "output_tokens": OUT, "variants": {}}
    for variant in VARIANTS:
        proc = subprocess.run([sys.executable, __file__, model, path, variant], capture_output=True, text=True,
                              check=True)
        result["variants"][variant] = json.loads(proc.stdout.strip().splitlines()[-1])
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
