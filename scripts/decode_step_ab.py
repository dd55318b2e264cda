"""A/B of the engine's decode step on the Llama-3-8B-shaped random model: fused element-wise kernels on/off,
overlapped (async) scheduling on/off.

For each variant (``F1A1`` = ``LORAPLEX_FUSED_OPS=1 LORAPLEX_ASYNC_SCHEDULING=1``, ...) a fresh engine times ``--steps`` whole engine steps
with ``--batch`` sequences decoding at ``--context`` (base, then distinct rank-16 adapters), and a torch
profiler run over a few base steps lists the GPU kernels (count and time per name). JSON to ``--out``.

    python3 scripts/decode_step_ab.py --out $OUT/decode_step_ab.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from pathlib import Path

import torch


def profile_steps(llm, batch: int, context: int, vocab: int, steps: int) -> dict:
    from loraplex import SamplingParams
    from loraplex.bench.workload import make_requests

    engine = llm.engine
    reqs = make_requests(batch, context, steps + 40, "base", vocab, seed=7)
    params = SamplingParams(max_tokens=steps + 40, ignore_eos=True, temperature=0.0)
    for i, r in enumerate(reqs):
        engine.add_request(f"prof-{i}", r.prompt_token_ids, params)
    for _ in range(20):  # prefill and settle into decoding
        engine.step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = (time.perf_counter() - start) / steps
    while engine.has_unfinished_requests():
        engine.step()
    kernels: dict[str, list[float]] = {}
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels.setdefault(evt.name[:90], [0, 0.0])
            k[0] += 1
            k[1] += evt.device_time_total if hasattr(evt, "device_time_total") else evt.cuda_time_total
    rows = sorted(({"kernel": n, "calls_per_step": c / steps, "us_per_step": t / steps} for n, (c, t) in
                   kernels.items()), key=lambda r: -r["us_per_step"])
    return {"profiled_step_wall_ms": wall * 1e3, "kernels_per_step": sum(r["calls_per_step"] for r in rows),
            "gpu_us_per_step": sum(r["us_per_step"] for r in rows), "top": rows[:40]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--variants", default="F1A1,F1A0,F0A0")
    args = ap.parse_args()

    from loraplex.bench.llama8b import RandomModelSpec, write_adapter_pool, write_random_model
    from loraplex.bench.offline import make_llm, measure_decode_step
    from loraplex.bench.roofline import ModelShape, decode_step_bytes, measure_copy_bandwidth

    dev = torch.device("cuda")
    work = Path("/tmp/loraplex-bench")
    t0 = time.perf_counter()
    model_dir = write_random_model(work / f"llama3-8b-shape-{args.layers}l", RandomModelSpec(num_layers=args.layers),
                                   dev)
    adapters = write_adapter_pool(model_dir, 16, 16, dev)
    print(f"model + adapters ready in {time.perf_counter() - t0:.1f} s", flush=True)
    shape = ModelShape.from_hf(json.loads((model_dir / "config.json").read_text()))
    bw = measure_copy_bandwidth(dev)
    result = {"copy_bandwidth_Bps": bw, "batch": args.batch, "context": args.context, "variants": {}}
    for variant in args.variants.split(","):
        os.environ["LORAPLEX_FUSED_OPS"] = variant[1]
        os.environ["LORAPLEX_ASYNC_SCHEDULING"] = variant[3]
        llm = make_llm(model_dir, "cuda", "bfloat16", 256, 16, max_num_seqs=256)
        out = {}
        for label, distinct in (("base", False), ("distinct", True)):
            try:
                step = measure_decode_step(llm, args.batch, args.context, args.steps, shape.vocab_size, adapters,
                                           distinct_adapters=distinct)
            except Exception as exc:  # noqa: BLE001 (report and go on to the next variant)
                print(f"{variant} {label}: FAILED {exc!r}", flush=True)
                continue
            ranks = [16] * args.batch if distinct else []
            floor = decode_step_bytes(shape, [round(step["mean_context"])] * args.batch, ranks).total / bw
            step["floor_s"], step["over_floor"] = floor, step["step_mean_s"] / floor
            out[label] = step
            print(f"{variant} {label}: {step['step_mean_s'] * 1e3:.2f} ms (median "
                  f"{step['step_median_s'] * 1e3:.2f}), floor {floor * 1e3:.2f} ms, x{step['over_floor']:.2f}",
                  flush=True)
        out["profile"] = profile_steps(llm, args.batch, args.context, shape.vocab_size, 8)
        prof = out["profile"]
        print(f"{variant} profile: {prof['kernels_per_step']:.0f} kernels/step, GPU busy "
              f"{prof['gpu_us_per_step'] / 1e3:.2f} ms/step, wall {prof['profiled_step_wall_ms']:.2f} ms", flush=True)
        for r in prof["top"][:25]:
            print(f"   {r['us_per_step']:9.1f} us  {r['calls_per_step']:6.1f}x  {r['kernel']}")
        result["variants"][variant] = out
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
