"""Offline throughput through ``loraplex.LLM``: base model vs adapters by popularity, and the decode step time.

Throughput = generated tokens ÷ wall time of one ``llm.generate`` over all N requests (``ignore_eos``,
greedy, so every request produces exactly its output length). Each popularity gets fresh random prompts
of the same lengths, so the prefix cache cannot carry work from one run to the next. The decode step is
timed inside the engine loop: ``batch`` requests of ``context`` prompt tokens are admitted, and once all
of them are decoding the next ``steps`` engine steps are timed one by one (each step ends with the sampled
tokens on the host, so its wall time is the whole step: scheduling, batch preparation, GPU work, sampling).
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from pathlib import Path

from loraplex.bench.workload import BenchRequest, make_requests, num_distinct_adapters

log = logging.getLogger(__name__)


def make_llm(model_dir: str | Path, device: str, dtype: str, max_loras: int, max_lora_rank: int, **engine_kw):
    """``loraplex.LLM`` with LoRA on; extra keywords are passed only if the engine config knows them."""
    from loraplex import LLM
    from loraplex.engine.config import EngineConfig

    known = {f.name for f in dataclasses.fields(EngineConfig)}
    extra = {k: v for k, v in engine_kw.items() if k in known and v is not None}
    dropped = sorted(set(engine_kw) - known)
    if dropped:
        log.warning("engine config has no %s: not passed", ", ".join(dropped))
    return LLM(model=str(model_dir), enable_lora=True, max_loras=max_loras, max_lora_rank=max_lora_rank,
               device=device, dtype=dtype, **extra)


def lora_requests(requests: list[BenchRequest], adapter_dirs: list[Path]) -> list:
    """Adapter k -> LoRARequest id k+1, weights from file k % len(adapter_dirs)."""
    from loraplex import LoRARequest

    return [None if r.adapter is None else
            LoRARequest(f"bench-{r.adapter}", r.adapter + 1, str(adapter_dirs[r.adapter % len(adapter_dirs)]))
            for r in requests]


def run_generate(llm, requests: list[BenchRequest], adapter_dirs: list[Path]) -> dict:
    from loraplex import SamplingParams

    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0.0) for r in requests]
    loras = lora_requests(requests, adapter_dirs)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, lora_request=loras)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    errors = [o.outputs[0].error for o in outputs if o.outputs[0].error]
    expected = sum(r.output_len for r in requests)
    if errors or generated != expected:
        raise RuntimeError(f"generate produced {generated} of {expected} tokens; errors: {errors[:3]}")
    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    return {
        "num_requests": len(requests), "num_adapters": num_distinct_adapters(requests),
        "prompt_tokens": prompt_tokens, "output_tokens": generated, "elapsed_s": elapsed,
        "output_tok_per_s": generated / elapsed, "total_tok_per_s": (generated + prompt_tokens) / elapsed,
        "req_per_s": len(requests) / elapsed,
    }


def run_popularities(
    llm, popularities: list[str], num_requests: int, input_len: int, output_len: int, len_dist: str,
    vocab_size: int, adapter_dirs: list[Path], seed: int = 0,
) -> list[dict]:
    rows = []
    for pop in popularities:
        requests = make_requests(num_requests, input_len, output_len, pop, vocab_size, seed, len_dist)
        row = {"popularity": pop, **run_generate(llm, requests, adapter_dirs)}
        log.info("offline %s: %.1f output tok/s", pop, row["output_tok_per_s"])
        rows.append(row)
    base = next((r for r in rows if r["popularity"] == "base"), None)
    for r in rows:
        r["over_base"] = r["output_tok_per_s"] / base["output_tok_per_s"] if base else None
    return rows


def measure_decode_step(
    llm, batch: int, context: int, steps: int, vocab_size: int, adapter_dirs: list[Path],
    distinct_adapters: bool, seed: int = 1,
) -> dict:
    """Mean / median wall time of ``steps`` engine steps with ``batch`` sequences all decoding."""
    from loraplex import SamplingParams

    popularity = "distinct" if distinct_adapters else "base"
    requests = make_requests(batch, context, steps + 4, popularity, vocab_size, seed=seed + context)
    loras = lora_requests(requests, adapter_dirs)
    engine = llm.engine
    params = SamplingParams(max_tokens=steps + 4, ignore_eos=True, temperature=0.0)
    ids = [f"step-bench-{seed}-{popularity}-{i}" for i in range(batch)]
    for rid, req, lora in zip(ids, requests, loras):
        engine.add_request(rid, req.prompt_token_ids, params, lora_request=lora)
    produced = dict.fromkeys(ids, 0)
    times: list[float] = []
    while engine.has_unfinished_requests():
        decoding = all(produced[r] >= 1 for r in ids)
        start = time.perf_counter()
        deltas = engine.step()
        elapsed = time.perf_counter() - start
        if decoding and len(times) < steps:
            times.append(elapsed)
        for d in deltas:
            if d.request_id in produced:
                produced[d.request_id] += len(d.token_ids)
    if not times:
        raise RuntimeError("no decode step was timed: the batch never decoded together")
    return {
        "batch": batch, "prompt_len": context, "mean_context": context + len(times) / 2 + 1,
        "num_adapters": batch if distinct_adapters else 0, "steps_timed": len(times),
        "step_mean_s": statistics.fmean(times), "step_median_s": statistics.median(times),
    }
