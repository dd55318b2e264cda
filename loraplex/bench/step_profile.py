"""``loraplex bench step-profile``: where the time of one decode step goes, phase by phase and kernel by kernel.

On the Llama-3-8B-shaped random model of the other benches, ``--batch`` requests of ``--context`` prompt tokens
are admitted (for each count N of ``--adapters``, request i uses adapter i mod N, all rank ``--rank``). Once all
of them are decoding, ``--steps`` engine steps are timed phase by phase (``instrument.PhaseTimers``: the live
engine's bound methods wrapped by the bench, the engine itself unchanged), then ``--profile-steps`` more steps
run under ``torch.profiler`` (CUDA activities on a GPU) and the trace is summarised (``trace_summary``): GPU
time by kernel category, GPU idle inside a step, kernels and host launch calls per step. The profiler slows
the host, so the phase times come from the unprofiled steps and the profiled steps only give GPU figures.
"""

from __future__ import annotations

import json
import logging
import statistics
import tempfile
import time
from pathlib import Path

from loraplex.bench.engine_flags import STEP_PROFILE, add_flags, engine_kwargs
from loraplex.bench.report import table

log = logging.getLogger(__name__)

PHASES = ("schedule", "pin adapters", "prepare inputs", "LoRA slots", "forward launch", "sample: logits",
          "sample: sampler", "sample: launch", "sample: D2H wait + results", "runner: other", "update", "detokenize",
          "deltas", "other")


def _csv_ints(text: str) -> list[int]:
    return [int(x) for x in str(text).split(",") if x != ""]


def add_step_profile_args(p) -> None:
    p.add_argument("--model", default=None, help="HF model directory (default: the random Llama-3-8B-shaped model)")
    p.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "loraplex-bench"))
    p.add_argument("--layers", type=int, default=32, help="layers of the random Llama-3-8B-shaped model")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=int, default=64, help="sequences decoding together")
    p.add_argument("--context", type=int, default=1024, help="prompt tokens per sequence")
    p.add_argument("--adapters", type=_csv_ints, default=[0],
                   help="comma-separated distinct-adapter counts, one profile each (0 = base model), e.g. 0,64")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--num-adapter-files", type=int, default=16, help="adapter k reads file k %% this")
    p.add_argument("--max-loras", type=int, default=None, help="GPU adapter slots (default: the largest --adapters)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="as bench offline (same CUDA-graph buckets)")
    p.add_argument("--steps", type=int, default=32, help="decode steps timed phase by phase")
    p.add_argument("--profile-steps", type=int, default=3, help="decode steps under torch.profiler")
    p.add_argument("--step-prompt-tokens", type=int, default=0,
                   help="every measured step also prefills one new request of this many prompt tokens (a mixed "
                        "step, run without the decode CUDA graphs, as a server's steps are under arrivals)")
    p.add_argument("--trace-dir", default=None, help="also keep each profiler trace here (.json.gz, Perfetto)")
    p.add_argument("--seed", type=int, default=0)
    add_flags(p, STEP_PROFILE)  # the engine options (bench/engine_flags.py)


def _smoke(args) -> None:
    args.layers, args.dtype = 2, "float32"
    args.batch, args.context = min(args.batch, 4), min(args.context, 16)
    args.adapters = sorted({min(n, args.batch) for n in args.adapters})
    args.rank, args.num_adapter_files, args.max_num_seqs = min(args.rank, 8), 2, 8
    args.steps, args.profile_steps = min(args.steps, 3), min(args.profile_steps, 2)
    args.step_prompt_tokens = min(args.step_prompt_tokens, 8)


def _phase_summary(records: list[dict[str, float]], calls: dict[str, int]) -> list[dict]:
    mean_step = statistics.fmean(r["step"] for r in records)
    rows = []
    for phase in (*PHASES, "step"):
        values = [r.get(phase, 0.0) for r in records]
        if phase not in ("other", "step") and not any(values):
            continue
        ordered = sorted(values)
        rows.append({"phase": phase, "mean_us": statistics.fmean(values) * 1e6,
                     "median_us": statistics.median(values) * 1e6,
                     "p90_us": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))] * 1e6,
                     "share": statistics.fmean(values) / mean_step,
                     "calls_per_step": calls.get(phase, 0) / len(records) if phase not in ("other", "step") else None})
    return rows


def profile_decode_steps(llm, batch: int, context: int, num_adapters: int, adapter_dirs: list[Path], steps: int,
                         profile_steps: int, vocab_size: int, seed: int = 0, trace_path: Path | None = None,
                         prompt_tokens: int = 0) -> dict:
    """Phase times of ``steps`` decode steps and the profiler summary of ``profile_steps`` more (see module doc).
    ``prompt_tokens``: before each measured step one new request of that many prompt tokens (and one output token)
    is added, so the step also prefills it (a mixed step)."""
    import torch

    from loraplex import SamplingParams
    from loraplex.bench.instrument import PhaseTimers
    from loraplex.bench.offline import lora_requests
    from loraplex.bench.trace_summary import STEP_PREFIX, summarize_trace
    from loraplex.bench.workload import make_requests

    engine = llm.engine
    device = torch.device(engine.runner.device)
    warm = 2  # decode steps before timing: the step right after the last prefill is not a typical decode
    # the first admitted sequences decode while later prompts prefill (>= 2,048 tokens a step): they must not
    # finish before the last measured step
    max_tokens = -(-batch * context // 2048) + warm + steps + profile_steps + 4
    requests = make_requests(batch, context, max_tokens, "base", vocab_size, seed=seed + 7919 * (num_adapters + 1))
    for i, r in enumerate(requests):
        r.adapter = i % num_adapters if num_adapters else None
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    if num_adapters:
        # read every adapter before the batch arrives: adapters load in the background, and with a cold page cache
        # their reads paced admission, so the first admitted sequences decoded ahead and finished before the last
        # measured step (seen on the H200)
        loads = make_requests(num_adapters, 8, 1, "base", vocab_size, seed=seed + 31)
        for i, r in enumerate(loads):
            r.adapter = i
        one = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
        for i, (req, lora) in enumerate(zip(loads, lora_requests(loads, adapter_dirs))):
            engine.add_request(f"step-profile-load-{num_adapters}-{i}", req.prompt_token_ids, one, lora_request=lora)
        while engine.has_unfinished_requests():
            engine.step()
    ids = [f"step-profile-{num_adapters}-{i}" for i in range(batch)]
    for rid, req, lora in zip(ids, requests, lora_requests(requests, adapter_dirs)):
        engine.add_request(rid, req.prompt_token_ids, params, lora_request=lora)
    produced = dict.fromkeys(ids, 0)
    extra = make_requests(steps + profile_steps, prompt_tokens, 1, "base", vocab_size, seed=seed + 104729) \
        if prompt_tokens else []
    extra_loras = lora_requests([requests[i % batch] for i in range(len(extra))], adapter_dirs) if extra else []
    extra_ids: list[str] = []

    def count(deltas) -> int:
        """The batch's sequences that got a token (the mixed steps' new requests are not counted)."""
        got = 0
        for d in deltas:
            if d.request_id in produced:
                produced[d.request_id] += len(d.token_ids)
                got += bool(d.token_ids)
        return got

    def add_prompt() -> None:
        if extra:
            i = len(extra_ids)
            extra_ids.append(f"step-profile-mix-{num_adapters}-{i}")
            engine.add_request(extra_ids[-1], extra[i].prompt_token_ids,
                               SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0), lora_request=extra_loras[i])

    while min(produced.values()) < 1 + warm:
        if not engine.has_unfinished_requests():
            raise RuntimeError("the requests finished before the batch decoded together")
        count(engine.step())
    timers = PhaseTimers(engine)
    sizes = []
    prompt_before = engine.scheduler.num_computed_prompt_tokens
    try:
        with timers.install():
            for _ in range(steps):
                add_prompt()
                sizes.append(count(timers.step()))
            activities = [torch.profiler.ProfilerActivity.CPU]
            if device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            timers.annotate = True
            with torch.profiler.profile(activities=activities) as prof:
                for i in range(profile_steps):
                    add_prompt()
                    with torch.profiler.record_function(f"{STEP_PREFIX}{i}"):
                        sizes.append(count(timers.step()))
        prompt_computed = engine.scheduler.num_computed_prompt_tokens - prompt_before
    finally:
        for rid in ids + extra_ids:
            engine.abort_request(rid)
        while engine.has_unfinished_requests():
            engine.step()
    if any(n != batch for n in sizes):
        raise RuntimeError(f"a measured step did not decode all {batch} sequences: {sizes}")
    with tempfile.TemporaryDirectory() as tmp:
        path = trace_path or Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = _read_trace(Path(path))
    timed, profiled = timers.steps[:steps], timers.steps[steps:]
    summary = summarize_trace(trace)
    step_mean = statistics.fmean(r["step"] for r in timed)
    return {
        "batch": batch, "context": context, "num_adapters": num_adapters, "prompt_tokens_per_step": prompt_tokens,
        "prompt_tokens_computed": prompt_computed,  # by the measured steps (the mixed steps' new prompts)
        "steps_timed": len(timed),
        "steps_profiled": len(profiled), "step_mean_s": step_mean,
        "step_median_s": statistics.median(r["step"] for r in timed),
        "profiled_step_mean_s": statistics.fmean(r["step"] for r in profiled) if profiled else None,
        "mean_context": context + warm + 1 + steps / 2,
        "phases": _phase_summary(timed, {k: v * len(timed) / (len(timed) + len(profiled))
                                         for k, v in timers.calls.items()}),
        "trace": summary,
        # GPU busy time barely changes under the profiler, the host does: this is the idle a normal step has
        "unprofiled_step_minus_gpu_busy_us": step_mean * 1e6 - summary["gpu_busy_us"] if summary["has_gpu_activity"]
        else None,
        "trace_file": str(trace_path) if trace_path else None,
    }


def _read_trace(path: Path) -> dict:
    if path.suffix == ".gz":
        import gzip

        with gzip.open(path, "rt") as f:
            return json.load(f)
    return json.loads(path.read_text())


def _label(n: int, rank: int) -> str:
    return "base" if n == 0 else f"{n} distinct rank-{rank} adapters"


def collect_step_profile(args, device) -> tuple[dict, list[tuple[str, str]]]:
    import torch

    from loraplex.bench.llama8b import write_adapter_pool
    from loraplex.bench.offline import make_llm
    from loraplex.bench.offline_run import prepare_model
    from loraplex.bench.report import environment
    from loraplex.bench.roofline import ModelShape, decode_step_bytes, measure_copy_bandwidth, roofline

    if args.smoke:
        _smoke(args)
    started = time.perf_counter()
    model_dir = prepare_model(args, device)
    shape = ModelShape.from_hf(json.loads((model_dir / "config.json").read_text()))
    most = max(args.adapters + [0])
    adapter_dirs = write_adapter_pool(model_dir, max(1, min(most, args.num_adapter_files)), args.rank, device) \
        if most else []
    llm = make_llm(model_dir, str(device), args.dtype, args.max_loras or max(1, most), args.rank,
                   max_num_seqs=args.max_num_seqs, seed=args.seed, **engine_kwargs(args, STEP_PROFILE))
    bandwidth = measure_copy_bandwidth(device, nbytes=(1 << 30) if device.type == "cuda" else 1 << 24)
    elem = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    log.info("step-profile: model and engine ready in %.1f s", time.perf_counter() - started)
    runs = []
    for n in args.adapters:
        t0 = time.perf_counter()
        run = profile_decode_steps(llm, args.batch, args.context, n, adapter_dirs, args.steps, args.profile_steps,
                                   shape.vocab_size, seed=args.seed, trace_path=_trace_path(args, n),
                                   prompt_tokens=args.step_prompt_tokens)
        run["label"] = _label(n, args.rank)
        ctx = round(run["mean_context"])
        step = decode_step_bytes(shape, [ctx] * args.batch, [args.rank] * min(n, args.batch), elem_bytes=elem)
        run["roofline"] = roofline(step, bandwidth, run["step_mean_s"])
        log.info("step-profile %s: step %.2f ms (floor %.2f ms), GPU idle %.0f us per profiled step, %.1f s",
                 run["label"], run["step_mean_s"] * 1e3, run["roofline"]["floor_s"] * 1e3,
                 run["trace"]["gpu_idle_us"], time.perf_counter() - t0)
        runs.append(run)
    del llm
    result = {"environment": environment(device), "model_dir": str(model_dir), "model_shape": vars(shape),
              "copy_bandwidth_Bps": bandwidth, "runs": runs,
              "settings": {k: v for k, v in vars(args).items() if k not in ("func", "bench_parser", "report_command")}}
    return result, step_profile_sections(runs, device)


def _trace_path(args, n: int) -> Path | None:
    if not args.trace_dir:
        return None
    Path(args.trace_dir).mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    return Path(args.trace_dir) / f"step-profile-{stamp}-{n}adapters.trace.json.gz"


def step_profile_sections(runs: list[dict], device) -> list[tuple[str, str]]:
    sections = []
    first = runs[0]
    mixed = first.get("prompt_tokens_per_step") or 0
    intro = (f"{first['batch']} sequences decoding together, prompt {first['context']} tokens; "
             + (f"every measured step also prefills a new request of {mixed} prompt tokens (mixed steps: no decode "
                "CUDA graph; the floor counts the decode work only); " if mixed else "")
             + f"{first['steps_timed']} steps timed phase by phase, then {first['steps_profiled']} under torch.profiler. "
             "Each phase is a wrapped method of the live engine (exclusive of the phases nested in it); `other` is "
             "the rest of `LLMEngine.step()`. `sample: D2H wait + results` holds the wait for the GPU to finish the "
             "step (the one device→host copy) and the tokens' conversion to host lists; with overlapped steps "
             "(asynchronous scheduling) it is the wait for the step launched by the previous call.")
    phases = {r["label"]: {p["phase"]: p for p in r["phases"]} for r in runs}
    names = [p for p in (*PHASES, "step") if any(p in ph for ph in phases.values())]
    rows, cols = [], [("phase", "phase")]
    for i, r in enumerate(runs):
        cols += [(f"m{i}", f"{r['label']}: mean µs"), (f"s{i}", "share"), (f"c{i}", "calls / step")]
    for name in names:
        row = {"phase": f"**{name}**" if name == "step" else name}
        for i, r in enumerate(runs):
            p = phases[r["label"]].get(name)
            if p:
                row.update({f"m{i}": p["mean_us"], f"s{i}": p["share"], f"c{i}": p["calls_per_step"]})
        rows.append(row)
    sections.append(("Host time per phase of a decode step", intro + "\n\n" + table(rows, cols)))

    idle_rows = []
    for r in runs:
        t = r["trace"]
        idle_rows.append({
            "label": r["label"], "step_ms": r["step_mean_s"] * 1e3, "floor_ms": r["roofline"]["floor_s"] * 1e3,
            "over_floor": r["roofline"]["measured_over_floor"],
            "prof_ms": t["step_wall_us"] / 1e3, "busy_ms": t["gpu_busy_us"] / 1e3 if t["has_gpu_activity"] else None,
            "idle_ms": t["gpu_idle_us"] / 1e3 if t["has_gpu_activity"] else None,
            "est_idle_ms": (r["unprofiled_step_minus_gpu_busy_us"] / 1e3
                            if r["unprofiled_step_minus_gpu_busy_us"] is not None else None),
            "kernels": t["kernels_per_step"] if t["has_gpu_activity"] else None,
            "launches": t["launch_calls_per_step"] if t["has_gpu_activity"] else None})
    body = table(idle_rows, [
        ("label", "step"), ("step_ms", "step ms (unprofiled)"), ("floor_ms", "HBM floor ms"),
        ("over_floor", "÷ floor"), ("prof_ms", "step ms (profiled)"), ("busy_ms", "GPU busy ms"),
        ("idle_ms", "GPU idle ms (profiled)"), ("est_idle_ms", "unprofiled step − GPU busy ms"),
        ("kernels", "kernels / step"), ("launches", "host launch calls / step")])
    note = ("GPU busy = the union of kernel, memcpy and memset intervals inside the step; idle = step − busy "
            "(host-only start, gaps between kernels, host work after the last kernel). The profiler slows the host, "
            "so the last idle column uses the unprofiled step time. Kernels replayed from a CUDA graph count one "
            "each; a graph replay is one host launch call.")
    if not first["trace"]["has_gpu_activity"]:
        note = f"No GPU activity in the trace (device {device}): the profiler recorded CPU operators only."
    sections.append(("GPU busy and idle inside a step", note + "\n\n" + body))

    if first["trace"]["has_gpu_activity"]:
        cats = {r["label"]: {c["category"]: c for c in r["trace"]["categories"]} for r in runs}
        rows, cols = [], [("category", "kernel category")]
        for i, r in enumerate(runs):
            cols += [(f"u{i}", f"{r['label']}: GPU µs / step"), (f"s{i}", "share"), (f"n{i}", "kernels / step")]
        for c in runs[0]["trace"]["categories"]:
            row = {"category": c["category"]}
            for i, r in enumerate(runs):
                x = cats[r["label"]][c["category"]]
                row.update({f"u{i}": x["gpu_us_per_step"], f"s{i}": x["share_of_gpu_time"],
                            f"n{i}": x["activities_per_step"]})
            rows.append(row)
        sections.append(("GPU time by kernel category", "Summed kernel time per profiled step (overlapping kernels "
                         "count in full); sampling = kernels launched by the sampler, the LM head counts as GEMM.\n\n"
                         + table(rows, cols)))
        for r in runs:
            body = table(r["trace"]["top_kernels"], [("name", "kernel"), ("category", "category"),
                                                     ("gpu_us_per_step", "GPU µs / step"), ("calls_per_step", "calls / step")])
            body += "\n\nBy the phase that launched it:\n\n" + table(
                r["trace"]["by_launch_phase"], [("phase", "phase"), ("gpu_us_per_step", "GPU µs / step")])
            sections.append((f"Top kernels: {r['label']}", body))
    else:
        for r in runs:
            ops = r["trace"]["host_ops"]
            body = f"{ops['ops_per_step']:.0f} host operators per profiled step.\n\n" + table(
                ops["top_ops"], [("name", "operator"), ("host_us_per_step", "host µs / step (inclusive)"),
                                 ("calls_per_step", "calls / step")])
            sections.append((f"Host operators: {r['label']}", body))
    return sections


def run_step_profile_cli(args, device, out_dir: str | None) -> int:
    from loraplex.bench.report import write_report

    result, sections = collect_step_profile(args, device)
    json_path, md_path = write_report("step-profile", result, sections, out_dir, args)
    print(md_path.read_text())
    print(f"wrote {json_path} and {md_path}")
    return 0
