"""Offline throughput through ``loraplex.LLM``: base model vs adapters by popularity, and the decode step time.

Throughput = generated tokens ÷ wall time of one ``llm.generate`` over all N requests (``ignore_eos``,
greedy, so every request produces exactly its output length). Each popularity gets fresh random prompts
of the same lengths, so the prefix cache cannot carry work from one run to the next. The decode step is
timed inside the engine loop: ``batch`` requests of ``context`` prompt tokens are admitted, and once all
of them are decoding the next ``steps`` engine steps are timed one by one (each step ends with the sampled
tokens on the host, so its wall time is the whole step: scheduling, batch preparation, GPU work, sampling).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from loraplex.bench.gpu_clocks import GpuClockSampler
from loraplex.bench.instrument import (
    ScheduleRecorder,
    StepRecord,
    new_compiled_variants,
    step_time_split,
    triton_compiled_variants,
)
from loraplex.bench.report import host_state
from loraplex.bench.workload import BenchRequest, fresh_prompts, make_requests, num_distinct_adapters

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


def adapter_rank_of(adapter_dirs: list[Path]) -> Callable[[int], int]:
    """Adapter id (k + 1, as ``lora_requests`` numbers them) -> the rank in its file's adapter_config.json."""
    ranks = [json.loads((Path(d) / "adapter_config.json").read_text())["r"] for d in adapter_dirs]
    return lambda adapter_id: ranks[(adapter_id - 1) % len(ranks)]


# engine counters whose change over a timed run the report keeps (where the time of an adapter workload went)
DIAGNOSTIC_COUNTERS = ("num_steps", "num_overlapped_steps", "num_decode_graph_steps", "num_piecewise_graph_steps",
                       "num_preemptions", "num_adapter_wait_steps",
                       "adapter_wait_seconds", "lora_slot_loads", "lora_prefetched_slot_loads", "lora_prefetch_deferrals", "lora_slot_evictions",
                       "lora_slot_moves", "lora_gemm_shrink_steps", "lora_host_loads", "lora_host_reuses", "lora_host_load_seconds", "prefix_cache_hit_tokens",
                       "lora_merges", "lora_merged_steps")


def run_generate(llm, requests: list[BenchRequest], adapter_dirs: list[Path],
                 steps: list[StepRecord] | None = None) -> dict:
    """One ``llm.generate`` over all requests; with ``steps`` (a list), every engine step is recorded into it."""
    from loraplex import SamplingParams

    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0.0) for r in requests]
    loras = lora_requests(requests, adapter_dirs)
    recorder = ScheduleRecorder(llm.engine) if steps is not None else contextlib.nullcontext()
    compiled_before = triton_compiled_variants()
    counters_before = llm.engine.counters
    # the GPU's clocks and power while the run lasts (nothing off CUDA): a slow round on a slower GPU shows there
    clocks = (GpuClockSampler(llm.engine.runner.device) if steps is not None else None)
    with recorder, (clocks or contextlib.nullcontext()):
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, lora_request=loras)
        end = time.perf_counter()
        elapsed = end - start
    diagnostics = {}
    if steps is not None:
        steps.extend(recorder.steps)
        # where the time went, and whether Triton compiled anything inside the timed window
        diagnostics = step_time_split(recorder.steps, end, llm.engine.device_wait_seconds)
        compiled = new_compiled_variants(compiled_before, triton_compiled_variants(), key_chars=2000)
        diagnostics["triton_compiles"] = None if compiled is None else len(compiled)
        diagnostics["triton_compiled"] = compiled  # which kernels, and their specialization keys
        counters_after = llm.engine.counters
        diagnostics["engine"] = {k: counters_after[k] - counters_before[k] for k in DIAGNOSTIC_COUNTERS
                                 if k in counters_after}
        diagnostics.update(host_state())  # right after the run: how fast the host ran Python then
        diagnostics.update(clocks.summary() or {})
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
        "req_per_s": len(requests) / elapsed, **({"diagnostics": diagnostics} if diagnostics else {}),
    }


def run_popularities(
    llm, popularities: list[str], num_requests: int, input_len: int, output_len: int, len_dist: str,
    vocab_size: int, adapter_dirs: list[Path], seed: int = 0,
    floor: Callable[[list[StepRecord]], dict] | None = None,
) -> list[dict]:
    """Throughput of each popularity. With ``floor`` (steps -> ``roofline.workload_floor``), each run's steps are
    recorded and its floor is reported beside it, and ``roofline_over_base`` = base floor time ÷ this run's floor
    time per output token: the ÷ base ratio with both runs at their floors (``hbm_roofline_over_base``: the same
    from the HBM bytes alone)."""
    rows = []
    for pop in popularities:
        requests = make_requests(num_requests, input_len, output_len, pop, vocab_size, seed, len_dist)
        steps: list[StepRecord] | None = [] if floor else None
        row = {"popularity": pop, **run_generate(llm, requests, adapter_dirs, steps)}
        compiled = row.get("diagnostics", {}).get("triton_compiles")
        if floor and compiled:
            # a kernel variant the warm-up missed was compiled (seconds) inside the timed window: the run is not
            # a measure of the engine; run the workload again (now compiled) and keep the first in the JSON. Same
            # lengths and adapters, new prompt tokens: the same prompts would be served from the prefix cache
            log.warning("offline %s: %d Triton compiles inside the timed window (%.2f s): running it again "
                        "(fresh prompts)", pop, compiled, row["elapsed_s"])
            first = row
            steps = []
            again = fresh_prompts(requests, vocab_size, seed)
            row = {"popularity": pop, **run_generate(llm, again, adapter_dirs, steps),
                   "discarded_run": {"elapsed_s": first["elapsed_s"], "reason": "Triton compiles in the timed window",
                                     "triton_compiled": first["diagnostics"]["triton_compiled"]}}
        if floor:
            row["roofline"] = floor(steps)
            row["floor_s_per_output_token"] = row["roofline"]["floor_s"] / row["output_tokens"]
            row["hbm_floor_s_per_output_token"] = row["roofline"]["hbm_floor_s"] / row["output_tokens"]
            row["wall_over_floor"] = row["elapsed_s"] / row["roofline"]["floor_s"]
        log.info("offline %s: %.1f output tok/s in %.1f s%s", pop, row["output_tok_per_s"], row["elapsed_s"],
                 f" (HBM floor {row['roofline']['floor_s']:.3g} s, {row['roofline']['mean_decode_adapters']:.1f} "
                 f"adapters and {row['roofline']['mean_decode_batch']:.0f} sequences per decode step)"
                 if floor and row["roofline"]["num_decode_steps"] else "")
        if "diagnostics" in row:
            d = row["diagnostics"]
            log.info("offline %s: %d decode steps in %.2f s, %d steps with prompt tokens in %.2f s, "
                     "Triton compiles in the timed window: %s%s", pop, d["decode_steps"], d["decode_s"],
                     d["prefill_steps"], d["prefill_s"], d["triton_compiles"],
                     f" ({', '.join(sorted({v.split(': ', 1)[0] for v in d['triton_compiled']}))})"
                     if d.get("triton_compiled") else "")
        rows.append(row)
    add_over_base(rows)
    return rows


def add_over_base(rows: list[dict]) -> None:
    """Each row's throughput ÷ the base row's of the same round (``round``, default 1), and (rows with a floor)
    the ratio the HBM roofline allows."""
    bases: dict[int, dict] = {}
    for r in rows:
        if r["popularity"] == "base":
            bases.setdefault(r.get("round", 1), r)
    for r in rows:
        base = bases.get(r.get("round", 1))
        r["over_base"] = r["output_tok_per_s"] / base["output_tok_per_s"] if base else None
        if "floor_s_per_output_token" in r:
            has = base is not None and "floor_s_per_output_token" in base
            roof = base["floor_s_per_output_token"] / r["floor_s_per_output_token"] if has else None
            r["roofline_over_base"] = roof
            r["hbm_roofline_over_base"] = (base["hbm_floor_s_per_output_token"] / r["hbm_floor_s_per_output_token"]
                                           if has else None)
            r["over_base_of_roofline"] = r["over_base"] / roof if roof else None


def measure_decode_step(
    llm, batch: int, context: int, steps: int, vocab_size: int, adapter_dirs: list[Path],
    distinct_adapters: bool, seed: int = 1,
) -> dict:
    """Mean / median wall time of ``steps`` engine steps with ``batch`` sequences all decoding."""
    from loraplex import SamplingParams

    popularity = "distinct" if distinct_adapters else "base"
    # the first sequences decode while later prompts prefill (>= 2,048 tokens a step): none may finish early
    max_tokens = steps + 4 + -(-batch * context // 2048)
    requests = make_requests(batch, context, max_tokens, popularity, vocab_size, seed=seed + context)
    loras = lora_requests(requests, adapter_dirs)
    engine = llm.engine
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    ids = [f"step-bench-{seed}-{popularity}-{i}" for i in range(batch)]
    for rid, req, lora in zip(ids, requests, loras):
        engine.add_request(rid, req.prompt_token_ids, params, lora_request=lora)
    produced = dict.fromkeys(ids, 0)
    times: list[float] = []
    while engine.has_unfinished_requests() and len(times) < steps:
        decoding = all(produced[r] >= 1 for r in ids)
        start = time.perf_counter()
        deltas = engine.step()
        elapsed = time.perf_counter() - start
        if decoding:
            times.append(elapsed)
        for d in deltas:
            if d.request_id in produced:
                produced[d.request_id] += len(d.token_ids)
    for rid in ids:
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    if not times:
        raise RuntimeError("no decode step was timed: the batch never decoded together")
    return {
        "batch": batch, "prompt_len": context, "mean_context": context + len(times) / 2 + 1,
        "num_adapters": batch if distinct_adapters else 0, "steps_timed": len(times),
        "step_mean_s": statistics.fmean(times), "step_median_s": statistics.median(times),
    }


def summarize_rounds(rows: list[dict]) -> list[dict]:
    """One row per popularity from rows of several rounds (``round`` 1..N, each popularity once per round, each
    ÷ its own round's base): the round whose ÷ base is the median (the lower of the middle two for even N; base:
    by output tok/s), with ``rounds``, ``over_base_min`` / ``over_base_max`` and the per-round lists added. Rows
    of one round are returned as they are."""
    if max((r.get("round", 1) for r in rows), default=1) == 1:
        return rows
    by_pop: dict[str, list[dict]] = {}
    for r in rows:
        by_pop.setdefault(r["popularity"], []).append(r)
    out = []
    for pop, runs in by_pop.items():
        ratios = [r.get("over_base") for r in runs]
        key = "output_tok_per_s" if pop == "base" or None in ratios else "over_base"
        ranked = sorted(runs, key=lambda r: r[key])
        row = dict(ranked[(len(ranked) - 1) // 2])
        row["rounds"] = len(runs)
        row["output_tok_per_s_rounds"] = [r["output_tok_per_s"] for r in runs]
        if None not in ratios:
            row["over_base_rounds"] = ratios
            row["over_base_min"], row["over_base_max"] = min(ratios), max(ratios)
        out.append(row)
    return out
