"""Summarise a torch.profiler Chrome trace of engine steps: GPU time by kernel category, GPU idle inside a step,
kernels and host launch calls per step.

Steps are the profiler ranges ``loraplex_step:<i>`` (``record_function``), phases the ranges ``phase:<name>``
(``instrument.PhaseTimers`` with ``annotate``). Each GPU activity (kernel, memcpy, memset) is matched to the
host call that launched it through its correlation id; kernels replayed from a CUDA graph carry the id of the
``cudaGraphLaunch``. The launching call's time picks the step and the phase that a kernel's time and count go to.
GPU idle inside a step = the step's host wall time − the union of the GPU activity intervals within it, whichever
step launched them (with overlapped steps a step's kernels run while the next one is prepared), so it counts
host-only time before the first kernel, gaps between kernels, and host work after the last one. A CPU-only trace
has no GPU activities: the summary then says so and counts the host operators instead.
"""

from __future__ import annotations

import re
from collections import defaultdict

STEP_PREFIX = "loraplex_step:"
PHASE_PREFIX = "phase:"
DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
LAUNCH_CALLS = re.compile(r"(cudaLaunchKernel|cuLaunchKernel|cudaGraphLaunch|cudaMemcpy|cudaMemset|cuMemcpy|cuMemset)")

CATEGORIES = ("GEMM", "attention", "LoRA shrink/expand", "KV store (+rope)", "elementwise/norm/rope", "sampling",
              "memcpy/memset", "other")
_GEMM = ("gemm", "gemv", "nvjet", "cutlass", "xmma", "cublas", "matmul", "splitkreduce")
_ATTENTION = ("attention", "attn", "_decode_split", "_decode_merge", "_prefill_kernel", "flash", "sdpa", "fmha")
_SAMPLING = ("argmax", "topk", "sort", "softmax", "multinomial", "exponential", "distribution", "argmin")
_ELEMENTWISE = ("norm", "rope", "rotary", "silu", "elementwise", "vectorized", "reduce", "index", "copy", "cat",
                "fill", "embedding", "gather", "scatter", "mul", "add", "where", "cumsum", "arange", "unrolled")


def classify(name: str, cat: str = "kernel", phase: str | None = None) -> str:
    """Category of one GPU activity from its name, the trace category, and the phase that launched it."""
    low = name.lower()
    if cat in ("gpu_memcpy", "gpu_memset") or low.startswith(("memcpy", "memset")):
        return "memcpy/memset"
    if "lora" in low:
        return "LoRA shrink/expand"
    if any(k in low for k in _GEMM):
        return "GEMM"
    if any(k in low for k in _ATTENTION):
        return "attention"
    if "store_kv" in low or "rope_store" in low or "kv_store" in low or "reshape_and_cache" in low:
        return "KV store (+rope)"
    in_sampling = phase is not None and phase.startswith(PHASE_PREFIX + "sample")
    if in_sampling or (phase is None and any(k in low for k in _SAMPLING)):
        return "sampling"
    if any(k in low for k in _ELEMENTWISE):
        return "elementwise/norm/rope"
    return "other"


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for lo, hi in sorted(intervals):
        if hi <= end:
            continue
        total += hi - max(lo, end)
        end = hi
    return total


def _innermost(ranges: list[tuple[float, float, str]], t: float) -> str | None:
    """Name of the shortest range containing t (ranges: (start, end, name))."""
    best = None
    for lo, hi, name in ranges:
        if lo <= t <= hi and (best is None or hi - lo < best[1] - best[0]):
            best = (lo, hi, name)
    return best[2] if best else None


def summarize_trace(trace: dict, top: int = 12) -> dict:
    """Per-step means over the ``loraplex_step:*`` ranges of ``trace`` (a Chrome trace dict); times in µs."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "ts" in e]
    steps = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), e["name"]) for e in events
                   if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith(STEP_PREFIX))
    if not steps:
        raise ValueError(f"the trace has no {STEP_PREFIX}* ranges")
    phases = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), e["name"]) for e in events
              if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith(PHASE_PREFIX)]
    runtime = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    launch_ts = {e["args"]["correlation"]: float(e["ts"]) for e in runtime if "correlation" in e.get("args", {})}
    device = [e for e in events if e.get("cat") in DEVICE_CATS]

    def step_of(t: float) -> int | None:
        for i, (lo, hi, _) in enumerate(steps):
            if lo <= t <= hi:
                return i
        return None

    per_step = [{"wall_us": hi - lo, "kernels": 0, "launch_calls": 0} for lo, hi, _ in steps]
    by_category: dict[str, float] = defaultdict(float)
    count_by_category: dict[str, int] = defaultdict(int)
    by_phase: dict[str, float] = defaultdict(float)
    by_kernel: dict[str, list] = defaultdict(lambda: [0.0, 0, ""])
    for e in device:
        start, dur = float(e["ts"]), float(e.get("dur", 0))
        launched = launch_ts.get(e.get("args", {}).get("correlation"), start)
        i = step_of(launched)
        if i is None:
            continue
        phase = _innermost(phases, launched)
        category = classify(e["name"], e["cat"], phase)
        per_step[i]["kernels"] += e["cat"] == "kernel"
        by_category[category] += dur
        count_by_category[category] += 1
        by_phase[(phase or "(no phase)").removeprefix(PHASE_PREFIX)] += dur
        k = by_kernel[e["name"]]
        k[0] += dur
        k[1] += 1
        k[2] = category
    for e in runtime:
        i = step_of(float(e["ts"]))
        if i is not None and LAUNCH_CALLS.search(e.get("name", "")):
            per_step[i]["launch_calls"] += 1
    spans = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in device]
    for s, (lo, hi, _) in zip(per_step, steps):
        # whatever ran on the GPU during the step, whichever step launched it (overlapped steps)
        clipped = [(max(a, lo), min(b, hi)) for a, b in spans if a < hi and b > lo]
        s["gpu_busy_us"] = _union_length(clipped)
        s["gpu_idle_us"] = s["wall_us"] - s["gpu_busy_us"]
    n = len(steps)
    gpu_total = sum(by_category.values())
    result = {
        "num_steps": n, "has_gpu_activity": bool(device),
        "step_wall_us": sum(s["wall_us"] for s in per_step) / n,
        "gpu_busy_us": sum(s["gpu_busy_us"] for s in per_step) / n,
        "gpu_idle_us": sum(s["gpu_idle_us"] for s in per_step) / n,
        "kernels_per_step": sum(s["kernels"] for s in per_step) / n,
        "launch_calls_per_step": sum(s["launch_calls"] for s in per_step) / n,
        "per_step": per_step,
        "categories": [{"category": c, "gpu_us_per_step": by_category.get(c, 0.0) / n,
                        "share_of_gpu_time": by_category.get(c, 0.0) / gpu_total if gpu_total else None,
                        "activities_per_step": count_by_category.get(c, 0) / n} for c in CATEGORIES],
        "by_launch_phase": [{"phase": p, "gpu_us_per_step": t / n} for p, t in sorted(by_phase.items(), key=lambda kv: -kv[1])],
        "top_kernels": [{"name": name, "category": cat, "gpu_us_per_step": t / n, "calls_per_step": c / n}
                        for name, (t, c, cat) in sorted(by_kernel.items(), key=lambda kv: -kv[1][0])[:top]],
    }
    if not device:
        result["host_ops"] = _host_ops(events, steps, top)
    return result


def _host_ops(events: list[dict], steps: list[tuple[float, float, str]], top: int) -> dict:
    """CPU-only trace: operators per step and the operators with the most inclusive host time."""
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    inside = [e for e in ops if any(lo <= float(e["ts"]) <= hi for lo, hi, _ in steps)]
    totals: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for e in inside:
        t = totals[e["name"]]
        t[0] += float(e.get("dur", 0))
        t[1] += 1
    n = len(steps)
    return {"ops_per_step": len(inside) / n,
            "top_ops": [{"name": name, "host_us_per_step": t / n, "calls_per_step": c / n}
                        for name, (t, c) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]]}
