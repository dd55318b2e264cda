"""Python GC pauses during an offline generate, with the heap as loaded and frozen (loraplex/engine/gc_heap.py).

    .venv/bin/python docs/benchmarks/scripts/gc_pauses.py [--requests 256] [--max-tokens 64]

Builds the demo model (random weights) once under /tmp, runs one generate per mode in a fresh subprocess, and
prints each collection's generation and duration (gc.callbacks): count, total, the oldest generation's pauses.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

CHILD = r'''
import gc, json, sys, time
from loraplex import LLM, SamplingParams
model_dir, mode, requests, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
llm = LLM(model_dir, dtype="float32", max_num_seqs=256, freeze_gc=(mode == "frozen"))
loaded = len(gc.get_objects())
pauses, start = [], {}
def cb(phase, info):
    if phase == "start":
        start["t"] = time.perf_counter()
    else:
        pauses.append((info["generation"], time.perf_counter() - start["t"]))
gc.callbacks.append(cb)
prompts = [{"prompt_token_ids": [1] + [5 + (i * 7 + j) % 400 for j in range(32)]} for i in range(requests)]
t = time.perf_counter()
llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=1))
wall = time.perf_counter() - t
gc.callbacks.remove(cb)
print(json.dumps({"mode": mode, "tracked_objects_after_load": loaded, "frozen": gc.get_freeze_count(),
                  "wall_s": wall, "collections": len(pauses), "total_ms": 1e3 * sum(p for _, p in pauses),
                  "gen2_ms": [round(1e3 * p, 1) for g, p in pauses if g == 2],
                  "max_ms": 1e3 * max((p for _, p in pauses), default=0.0)}))
'''


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args()
    from loraplex.demo import DemoModelSpec, build_demo_model

    model_dir = Path("/tmp/loraplex-gc-pauses/model")
    if not (model_dir / "config.json").exists():
        build_demo_model(model_dir, DemoModelSpec(arch="llama", adapters=0, seed=1))
    for mode in ("as-loaded", "frozen"):
        started = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", CHILD, str(model_dir), mode, str(args.requests),
                              str(args.max_tokens)], capture_output=True, text=True, check=True)
        row = json.loads(out.stdout.strip().splitlines()[-1])
        print(json.dumps(row), f"({time.perf_counter() - started:.0f} s with start-up)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
