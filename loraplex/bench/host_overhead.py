"""``loraplex bench host-overhead``: host time of one decode step at N running requests, model excluded.

Runs the engine's real host path on the CPU: ``Scheduler.schedule`` (with the block manager and prefix
cache), ``StepInputBuilder.prepare`` (padded to the CUDA-graph bucket, as the graph path does), the
``StepSampler`` (row selection, the ``Sampler`` on a tiny logits projection, results to host dicts) and
``Scheduler.update_from_output`` (append, stop checks, full-block hashing). The model forward is
replaced by a fixed hidden-state tensor; with ``--tokenizer`` each request carries the engine's
incremental detokenizer (text is decoded in ``update``), without it no text is made. Prompts are
prefilled first through the same scheduler, so the timed steps are steady-state decodes at the requested
context length.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import random
import statistics
import time
from pathlib import Path

log = logging.getLogger(__name__)

PHASES = ("schedule", "prepare", "sample", "update")


def add_host_overhead_args(p) -> None:
    p.add_argument("--num-requests", type=int, default=256, help="running requests (all decoding)")
    p.add_argument("--context", type=int, default=1024, help="prompt tokens per request")
    p.add_argument("--steps", type=int, default=300, help="timed decode steps")
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--sampling", default="greedy", choices=("greedy", "random", "penalties"),
                   help="sampling params of every request (penalties: repetition + frequency)")
    p.add_argument("--no-graph-padding", action="store_true", help="prepare as the eager path (no bucket padding)")
    p.add_argument("--tokenizer", default=None, help="HF tokenizer directory: requests get the engine's incremental "
                                                    "detokenizer, so `update` includes the text (default: no text)")
    p.add_argument("--out", default=None, help="markdown report path (also writes .json next to it)")
    p.add_argument("--smoke", action="store_true", help="a few small steps: checks the harness only")


def run_host_overhead(*args, **kwargs) -> dict:
    """Timed decode steps (see module doc); returns per-phase wall and thread-CPU microseconds."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a step's host work is single-threaded; extra threads only add noise here
    try:
        return _run(*args, **kwargs)
    finally:
        torch.set_num_threads(threads)


def _run(num_requests: int = 256, context: int = 1024, steps: int = 300, warmup: int = 30,
         block_size: int = 16, sampling: str = "greedy", graph_padding: bool = True,
         seed: int = 0, tokenizer: str | None = None) -> dict:
    import torch

    from loraplex.engine.block_manager import BlockManager
    from loraplex.engine.config import EngineConfig
    from loraplex.engine.cuda_graphs import graph_buckets
    from loraplex.engine.request import Request
    from loraplex.engine.sampler import Sampler
    from loraplex.engine.sampling_params import SamplingParams
    from loraplex.engine.scheduler import Scheduler
    from loraplex.engine.step_inputs import StepInputBuilder
    from loraplex.engine.step_sampler import StepSampler

    cpu = torch.device("cpu")
    rng = random.Random(seed)
    # early requests decode while later prompts prefill, so leave room for those tokens too
    max_len = 2 * context + steps + warmup + 64
    config = EngineConfig(block_size=block_size, max_num_seqs=num_requests, max_model_len=max_len,
                          max_num_batched_tokens=max(8192, num_requests))
    blocks_per_seq = -(-max_len // block_size)
    block_manager = BlockManager(num_requests * blocks_per_seq + 1, block_size, enable_prefix_caching=True)
    sched = Scheduler(config, block_manager)
    params = {"greedy": SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True),
              "random": SamplingParams(max_tokens=None, temperature=0.8, top_p=0.95, ignore_eos=True),
              "penalties": SamplingParams(max_tokens=None, temperature=0.0, repetition_penalty=1.1,
                                          frequency_penalty=0.2, ignore_eos=True)}[sampling]
    # tiny logits: on a GPU the logits math is device work; here it would only add CPU compute to the host path
    vocab, hidden_size = 64, 16
    tok = None
    if tokenizer is not None:
        from loraplex.engine.detokenizer import IncrementalDetokenizer
        from loraplex.engine.engine_core import load_tokenizer

        tok = load_tokenizer(tokenizer)
    for i in range(num_requests):  # one SamplingParams object each, as the server creates them
        p = SamplingParams(**{k: getattr(params, k) for k in params.__dataclass_fields__})
        req = Request(request_id=f"r{i}", prompt_token_ids=[rng.randrange(1, vocab) for _ in range(context)],
                      sampling_params=p)
        if tok is not None:
            req.detokenizer = IncrementalDetokenizer(tok, req.prompt_token_ids, p.skip_special_tokens)
        sched.add_request(req)
    builder = StepInputBuilder(num_requests, config.max_num_batched_tokens, max_len, block_size, cpu)
    buckets = graph_buckets(num_requests)

    def bucket_for(n: int):
        return next((b for b in buckets if b >= n), None)

    weight = torch.randn(vocab, hidden_size)
    step_sampler = StepSampler(lambda h: (h @ weight.T).float(), Sampler(cpu, seed), cpu)
    hidden = torch.randn(config.max_num_batched_tokens, hidden_size)
    pad = None if not graph_padding else bucket_for

    def step(times: dict[str, list[float]] | None, cpu_times: dict[str, list[float]] | None) -> int:
        marks = [(time.perf_counter_ns(), time.thread_time_ns())]
        out = sched.schedule()
        marks.append((time.perf_counter_ns(), time.thread_time_ns()))
        batch = builder.prepare(out, pad)
        marks.append((time.perf_counter_ns(), time.thread_time_ns()))
        result = step_sampler(out, batch, hidden[:batch.num_rows])
        marks.append((time.perf_counter_ns(), time.thread_time_ns()))
        sched.update_from_output(out, result)
        marks.append((time.perf_counter_ns(), time.thread_time_ns()))
        if times is not None:
            for k, name in enumerate(PHASES):
                times[name].append((marks[k + 1][0] - marks[k][0]) / 1e3)
                cpu_times[name].append((marks[k + 1][1] - marks[k][1]) / 1e3)
        return batch.num_seqs if batch.is_decode else 0

    prefill_steps = 0
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running) or sched.waiting:
        step(None, None)
        prefill_steps += 1
    for _ in range(warmup):
        step(None, None)
    times: dict[str, list[float]] = {name: [] for name in PHASES}
    cpu_times: dict[str, list[float]] = {name: [] for name in PHASES}
    writes_before = builder.rows.num_row_writes
    gc.collect()
    gc.disable()  # collector pauses are real but belong to no phase; reported runs keep them out
    try:
        decode_batches = [step(times, cpu_times) for _ in range(steps)]
    finally:
        gc.enable()
    assert all(b == num_requests for b in decode_batches), "every timed step must decode every request"
    times["total"] = [sum(v) for v in zip(*(times[n] for n in PHASES))]
    cpu_times["total"] = [sum(v) for v in zip(*(cpu_times[n] for n in PHASES))]
    summary = {name: {"median_us": statistics.median(v), "p90_us": _quantile(v, 0.9),
                      "cpu_median_us": statistics.median(cpu_times[name])} for name, v in times.items()}
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {"num_requests": num_requests, "context": context, "steps": steps, "block_size": block_size,
            "sampling": sampling, "graph_padding": graph_padding, "detokenize": tokenizer is not None,
            "prefill_steps": prefill_steps,
            "block_table_row_writes_per_step": (builder.rows.num_row_writes - writes_before) / steps, "phases_us": summary, "torch": torch.__version__,
            "cpu_count": os.cpu_count(), "load_average_1m": load}


def _load(result: dict) -> str:
    load = result["load_average_1m"]
    return "n/a" if load is None else f"{load:.2f}"


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def render_markdown(result: dict, command: str) -> str:
    lines = [
        "# Host overhead per decode step (CPU, model excluded)", "",
        f"Command: `{command}`", "",
        f"{result['num_requests']} running requests, all decoding, context {result['context']} tokens "
        f"(block size {result['block_size']}), sampling `{result['sampling']}`, "
        f"{'padded to the CUDA-graph bucket' if result['graph_padding'] else 'eager layout (no padding)'}, "
        f"{'with' if result.get('detokenize') else 'without'} detokenization; "
        f"{result['steps']} timed steps, torch {result['torch']}; block-table rows rewritten per step: "
        f"{result['block_table_row_writes_per_step']:.1f} of {result['num_requests']}.", "",
        f"Machine: {result['cpu_count']} CPU cores, 1-minute load average {_load(result)} while it ran.",
        "Wall time includes waiting for a core when the machine is busy; thread CPU time "
        "(`time.thread_time_ns`) counts only the time this thread ran.", "",
        "| phase | wall median µs | wall p90 µs | thread CPU median µs |", "|---|---:|---:|---:|",
    ]
    for name in (*PHASES, "total"):
        row = result["phases_us"][name]
        label = f"**{name}**" if name == "total" else name
        lines.append(f"| {label} | {row['median_us']:.0f} | {row['p90_us']:.0f} | {row['cpu_median_us']:.0f} |")
    lines += [
        "", "Phases: `schedule` = `Scheduler.schedule()` (block allocation, prefix-cache bookkeeping, KV waste);",
        "`prepare` = `StepInputBuilder.prepare()` (token ids, positions, slot mapping, block tables, offsets);",
        "`sample` = `StepSampler` host work plus the sampler on a 16x64 logits projection (CPU torch ops);",
        "`update` = `Scheduler.update_from_output()` (append, stop checks, prefix-cache hashing of full blocks,",
        "and with `--tokenizer` the batched incremental detokenization).",
        "Not included: the model forward, the host->device copies (pinned, asynchronous on CUDA) and the",
        "engine's per-request `TokenDelta`s.",
    ]
    return "\n".join(lines) + "\n"


def run_host_overhead_cli(args) -> int:
    from loraplex.bench.report import command_line

    command = command_line(args)
    if args.smoke:
        result = run_host_overhead(num_requests=8, context=40, steps=5, warmup=2, block_size=args.block_size,
                                   sampling=args.sampling, graph_padding=not args.no_graph_padding,
                                   tokenizer=args.tokenizer)
    else:
        result = run_host_overhead(args.num_requests, args.context, args.steps, args.warmup, args.block_size,
                                   args.sampling, not args.no_graph_padding, tokenizer=args.tokenizer)
    text = render_markdown(result, command)
    print(text)
    if args.out:
        path = Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        path.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {path} and {path.with_suffix('.json')}")
    return 0
