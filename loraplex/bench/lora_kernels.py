"""Microbenchmark of the LoRA shrink/expand kernels on Llama-3-8B projection shapes.

    python -m loraplex.bench.lora_kernels --out docs/benchmarks/lora_kernels_h200.json     # on a GPU
    TRITON_INTERPRET=1 python -m loraplex.bench.lora_kernels --smoke --out /tmp/lora.json   # CPU check
    python -m loraplex.bench.lora_kernels --step-sweep [--step-sweep-mode two-launch] --out /tmp/sweep.json

``--step-sweep`` times each projection's launches over all layers as one CUDA graph (no host launch cost, which
``do_bench`` partly exposes for the 10-50 us decode kernels) for many launch configurations, then the whole step
with the fastest per projection; that is the figure to tune decode against.

Measures, in one run: the device copy bandwidth (bytes read + written by a large device-to-device copy);
shrink and expand per fused projection (q|k|v, o, gate|up, down) for decode (64 tokens over 64 distinct
adapters) and prefill (8,192 tokens over 8 adapters) at ranks 16 and 64: median time (triton's do_bench,
L2 flushed between calls), the bytes each kernel must move at the adapters' real rank, GB/s and % of the
copy bandwidth; and all LoRA work of one decode step (32 layers x 4 fused projections = all 7 modules,
64 tokens on 64 distinct rank-16 adapters) replayed as one CUDA graph through the engine's own
``LoRAStep.add`` path. Writes JSON to --out and a markdown table next to it (.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import itertools
import json
import logging
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from loraplex.bench.report import markdown_head
from loraplex.bench.roofline import measure_copy_bandwidth

log = logging.getLogger(__name__)

LLAMA3_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
             "num_key_value_heads": 8, "head_dim": 128, "num_hidden_layers": 32}
SMOKE = {"hidden_size": 64, "intermediate_size": 176, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 16, "num_hidden_layers": 1}  # one layer: the interpreter pays per program
STEP_TARGET_MS = 2.0
SWEEP = {"split_k": (1, 2, 4, 8, 16), "block_k": (64, 128, 256), "warps": (2, 4, 8), "stages": (2, 3, 4),
         "block_n": (64, 128, 256), "n_splits": (1, 2, 4, 8, 16, 32)}


def _median_seconds(fn, device: torch.device, reps: int) -> float:
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=10, rep=max(20, reps), return_mode="median") / 1e3
    fn()
    times = []
    for _ in range(max(1, reps // 20)):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _pool_case(shapes, proj: str, num_tokens: int, num_adapters: int, rank: int, device, dtype, seed: int):
    """One fused projection: x, out, stacked weights (one slot per adapter), ranks, scaling, tokens."""
    from loraplex.kernels.lora_testing import make_lora_batch

    widths = shapes.slice_widths(proj)
    slots = (torch.arange(num_tokens) * num_adapters // num_tokens).to(torch.int32)  # equal runs per adapter
    return make_lora_batch(num_tokens, shapes.proj_in(proj), widths, num_slots=num_adapters, max_rank=rank,
                           slot_ranks=[[rank] * num_adapters for _ in widths], dtype=dtype, device=device,
                           seed=seed, token_slots=slots)


def _timed_pair(b, cfg, device, reps: int, kernels=("shrink", "expand")) -> tuple[float | None, float | None]:
    """Median seconds of (shrink, expand) for one batch under one launch configuration (None: not timed)."""
    from loraplex.kernels.lora_expand import lora_expand, slice_col_align
    from loraplex.kernels.lora_meta import build_lora_meta
    from loraplex.kernels.lora_shrink import lora_shrink, shrink_split

    meta = build_lora_meta(b.token_slots, b.lora_a.shape[0], cfg.block_m)
    parts, progs = cfg.split_k_max or cfg.split_k, cfg.split_k * meta.max_chunks  # as lora_ops.lora_apply
    shrink_kw = dict(split_k=parts, progs=progs, block_r=cfg.block_r, block_k=cfg.block_k,
                     num_warps=cfg.shrink_warps, num_stages=cfg.shrink_stages, pdl=cfg.pdl)
    chunk_ranks = b.ranks.index_select(1, meta.chunk_slots.clamp(min=0)) if cfg.chunk_tables else None
    shrink_kw["chunk_ranks"] = chunk_ranks
    y = lora_shrink(b.x, b.lora_a, b.ranks, meta, **shrink_kw)
    width = b.max_slice_width
    split = shrink_split(b.x.shape[1], meta, parts, cfg.block_k, progs)

    def shrink():
        lora_shrink(b.x, b.lora_a, b.ranks, meta, y=y, **shrink_kw)

    align = slice_col_align(b.slice_loc.tolist())  # host copy, outside any timing

    def expand():
        lora_expand(y, b.lora_b, b.ranks, b.scaling, b.slice_loc, width, meta, b.out, block_n=cfg.block_n,
                    n_splits=cfg.expand_splits, num_warps=cfg.expand_warps, num_stages=cfg.expand_stages,
                    col_align=align, pdl=cfg.pdl, prefetch_out=cfg.prefetch_out, chunk_ranks=chunk_ranks, **split)

    return tuple(_median_seconds(fn, device, reps) if name in kernels else None
                 for name, fn in (("shrink", shrink), ("expand", expand)))


def _timed_fused(b, cfg, device, reps: int) -> float:
    """Median seconds of one fused decode launch (shrink + expand) under ``cfg``."""
    from loraplex.kernels.lora_fused import lora_fused
    from loraplex.kernels.lora_meta import build_lora_meta

    meta = build_lora_meta(b.token_slots, b.lora_a.shape[0], cfg.block_m)
    num_slices = len(b.slice_loc) - 1
    y = torch.empty(max(1, cfg.fused_split_k), num_slices, b.x.shape[0], b.lora_a.shape[2], dtype=torch.float32,
                    device=b.x.device)
    counters = torch.zeros(meta.max_chunks * num_slices, dtype=torch.int32, device=b.x.device)
    width = b.max_slice_width

    def fused():
        lora_fused(b.x, b.out, b.lora_a, b.lora_b, b.ranks, b.scaling, b.slice_loc, width, meta,
                   split_k=cfg.fused_split_k, n_splits=cfg.fused_n_splits, block_k=cfg.fused_block_k,
                   block_n=cfg.fused_block_n, y=y, counters=counters, num_warps=cfg.fused_warps,
                   num_stages=cfg.fused_stages)

    return _median_seconds(fused, device, reps)


def _fused_variants(b, cfg) -> list:
    """Both fused designs at several program counts (around 1-8 programs per (chunk, slice))."""
    k_dim = b.x.shape[1]
    out = [dataclasses.replace(cfg, fused=True, fused_split_k=sk, fused_n_splits=1, fused_block_k=128)
           for sk in (2, 4, 8) if k_dim // sk >= 256]
    out += [dataclasses.replace(cfg, fused=True, fused_split_k=1, fused_n_splits=ns, fused_block_n=128)
            for ns in (1, 2, 4, 8)]
    return out


def _sweep_fused(b, cfg, device, reps: int) -> tuple[float, object]:
    """Fastest fused configuration: the designs first, then tiles / warps / stages around the best one."""
    best = (_timed_fused(b, cfg, device, reps), cfg)

    def attempt(trial):
        nonlocal best
        try:
            seconds = _timed_fused(b, trial, device, reps)
        except Exception as exc:  # e.g. a tile set over the shared-memory limit: skip that configuration
            log.warning("fused config %s failed: %s", _fused_summary(trial), str(exc).splitlines()[0][:200])
            return
        if seconds < best[0]:
            best = (seconds, trial)

    for trial in _fused_variants(b, cfg):
        attempt(trial)
    center = best[1]
    for change in (dict(fused_block_k=256, fused_block_n=256), dict(fused_warps=8), dict(fused_stages=4),
                   dict(fused_warps=2)):
        attempt(dataclasses.replace(center, **change))
    return best


def _fused_summary(cfg) -> dict:
    return {k: getattr(cfg, k) for k in ("fused_split_k", "fused_n_splits", "fused_block_k", "fused_block_n",
                                         "fused_warps", "fused_stages")}


def _sweep(b, cfg, device, reps: int) -> dict:
    """Fastest shrink and expand configurations around the default (block_m kept: it fixes the metadata)."""
    best_shrink = best_expand = None
    for split_k, block_k, warps, stages in itertools.product(SWEEP["split_k"], SWEEP["block_k"], SWEEP["warps"],
                                                             SWEEP["stages"]):
        if b.x.shape[1] < split_k * block_k:
            continue
        trial = dataclasses.replace(cfg, split_k=split_k, block_k=block_k, shrink_warps=warps, shrink_stages=stages)
        seconds = _timed_pair(b, trial, device, reps, kernels=("shrink",))[0]
        if best_shrink is None or seconds < best_shrink[0]:
            best_shrink = (seconds, dict(split_k=split_k, block_k=block_k, warps=warps, stages=stages))
    for block_n, n_splits, warps in itertools.product(SWEEP["block_n"], SWEEP["n_splits"], SWEEP["warps"]):
        if n_splits > -(-b.max_slice_width // block_n):
            continue
        trial = dataclasses.replace(cfg, block_n=block_n, expand_splits=n_splits, expand_warps=warps)
        seconds = _timed_pair(b, trial, device, reps, kernels=("expand",))[1]
        if best_expand is None or seconds < best_expand[0]:
            best_expand = (seconds, dict(block_n=block_n, n_splits=n_splits, warps=warps))
    return {"shrink": best_shrink, "expand": best_expand}


def _bench_case(shapes, regime: str, num_tokens: int, num_adapters: int, rank: int, proj: str, device, dtype,
                copy_bw: float, reps: int, sweep: bool, sweep_two_launch: bool = False,
                best_fused: dict | None = None) -> list[dict]:
    from loraplex.kernels.lora_ops import choose_config
    from loraplex.kernels.lora_shrink import pdl_supported

    elem = torch.finfo(dtype).bits // 8
    b = _pool_case(shapes, proj, num_tokens, num_adapters, rank, device, dtype, seed=rank)
    k_dim, n_total, num_slices = b.x.shape[1], b.out.shape[1], len(b.slice_loc) - 1
    cfg = choose_config(num_tokens, num_adapters, num_adapters, rank, k_dim, num_slices, b.max_slice_width,
                        pdl=pdl_supported(device))
    shrink_s, expand_s = _timed_pair(b, cfg, device, reps)
    best = _sweep(b, cfg, device, max(20, reps // 4)) if sweep and sweep_two_launch else {}
    y_bytes = cfg.split_k * num_slices * num_tokens * rank * 4
    figures = (
        ("shrink", shrink_s, (num_tokens * k_dim + num_adapters * num_slices * rank * k_dim) * elem + y_bytes),
        ("expand", expand_s, y_bytes + (num_adapters * rank * n_total + 2 * num_tokens * n_total) * elem),
    )
    rows = []
    for kernel, seconds, nbytes in figures:
        row = {
            "regime": regime, "tokens": num_tokens, "adapters": num_adapters, "rank": rank, "proj": proj,
            "kernel": kernel, "K": k_dim if kernel == "shrink" else rank,
            "N": num_slices * rank if kernel == "shrink" else n_total, "split_k": cfg.split_k,
            "block_m": cfg.block_m, "expand_splits": cfg.expand_splits, "time_us": seconds * 1e6, "bytes": nbytes, "gb_s": nbytes / seconds / 1e9,
            "pct_copy_bw": 100 * nbytes / seconds / copy_bw,
        }
        if best.get(kernel):
            best_s, best_cfg = best[kernel]
            row.update(best_time_us=best_s * 1e6, best_pct_copy_bw=100 * nbytes / best_s / copy_bw,
                       best_config=best_cfg)
        rows.append(row)
        log.info("%s", row)
    if cfg.fused:
        # the launch decode steps use: shrink + expand in one kernel; bytes = x, A, B, out read + written
        nbytes = (num_tokens * k_dim + num_adapters * rank * (num_slices * k_dim + n_total)
                  + 2 * num_tokens * n_total) * elem
        seconds = _timed_fused(b, cfg, device, reps)
        row = {"regime": regime, "tokens": num_tokens, "adapters": num_adapters, "rank": rank, "proj": proj,
               "kernel": "fused", "K": k_dim, "N": n_total, "split_k": cfg.fused_split_k, "block_m": cfg.block_m,
               "expand_splits": cfg.fused_n_splits, "time_us": seconds * 1e6, "bytes": nbytes,
               "gb_s": nbytes / seconds / 1e9, "pct_copy_bw": 100 * nbytes / seconds / copy_bw,
               "two_launch_us": (shrink_s + expand_s) * 1e6, "config": _fused_summary(cfg)}
        if sweep:
            best_s, best_cfg = _sweep_fused(b, cfg, device, max(20, reps // 4))
            row.update(best_time_us=best_s * 1e6, best_pct_copy_bw=100 * nbytes / best_s / copy_bw,
                       best_config=_fused_summary(best_cfg))
            if best_fused is not None:
                best_fused[(rank, proj)] = best_cfg
        rows.append(row)
        log.info("%s", row)
    return rows


def bench_kernels(shapes, regimes, ranks, device, dtype, copy_bw: float, reps: int, sweep: bool,
                  sweep_two_launch: bool = False, best_fused: dict | None = None) -> list[dict]:
    from loraplex.adapters.modules import PROJ_MODULES

    rows = []
    for regime, num_tokens, num_adapters in regimes:
        for rank in ranks:
            for proj in PROJ_MODULES:
                rows += _bench_case(shapes, regime, num_tokens, num_adapters, rank, proj, device, dtype, copy_bw,
                                    reps, sweep and regime == "decode", sweep_two_launch, best_fused)
    return rows


# the three decode workloads of the step figure: 64 tokens on 64 distinct adapters, on 8 (8 tokens each), on one
STEP_MIXES = (("distinct", 64), ("8 adapters", 8), ("identical", 1))


def _mix_slots(num_tokens: int, adapters: int, device) -> torch.Tensor:
    """Slots 0..adapters-1, equal counts, in a seeded random order (a batch is not sorted by adapter)."""
    gen = torch.Generator().manual_seed(adapters)
    slots = torch.arange(num_tokens) % adapters
    return slots[torch.randperm(num_tokens, generator=gen)].to(torch.int32).to(device)


def _before_step_class(before_dir: str | None):
    """LoRAStep of the previous kernels (a copy of their modules under ``before_dir``), for before/after figures
    in one run; None when the copy is absent."""
    if not before_dir or not Path(before_dir, "lora_before", "mapping.py").exists():
        return None
    sys.path.insert(0, str(Path(before_dir).resolve()))
    return importlib.import_module("lora_before.mapping").LoRAStep


def _config_summary(cfg) -> dict:
    keys = ("split_k", "split_k_max", "block_k", "shrink_warps", "expand_splits", "block_n", "expand_warps", "pdl",
            "prefetch_out", "weight_prefetch", "ticketed", "ticket_warps")
    return {k: getattr(cfg, k) for k in keys if hasattr(cfg, k)}


class _DecodeStepBench:
    """All LoRA work of one decode step as the engine's decode CUDA graph runs it: a LoRAStep built from the
    static slot buffer inside the graph (metadata on the device) for ``min(T, max_loras)`` adapters (tiles planned
    for distinct adapters, whatever mix is replayed), then 32 layers x qkv, o, gate|up, down through
    ``LoRAStep.add``. Every slot of the pool holds a distinct random adapter (distinct weights per layer)."""

    def __init__(self, shapes, num_tokens: int, rank: int, device, dtype, num_slots: int | None = None):
        from loraplex.adapters.modules import PROJ_MODULES
        from loraplex.adapters.slot_pool import SlotPool

        self.shapes, self.num_tokens, self.rank, self.device, self.dtype = shapes, num_tokens, rank, device, dtype
        self.projs = tuple(PROJ_MODULES)
        self.pool = SlotPool(shapes, num_slots or num_tokens, rank, device, dtype)
        gen = torch.Generator(device=device).manual_seed(0)
        for t in (*self.pool.a.values(), *self.pool.bt.values()):
            t.normal_(0.0, 0.02, generator=gen)
        self.pool.ranks.fill_(rank)
        self.pool.scaling.fill_(2.0)
        self.slots = torch.full((num_tokens,), -1, dtype=torch.int32, device=device)  # the static buffer
        self.xs = {p: torch.randn(num_tokens, shapes.proj_in(p), dtype=dtype, device=device) for p in self.projs}
        self.outs = {p: torch.randn(num_tokens, sum(shapes.slice_widths(p)), dtype=dtype, device=device)
                     for p in self.projs}
        self.num_active = min(num_tokens, self.pool.max_loras)

    def make_step(self, step_cls, overrides: dict | None = None, num_active: int | None = None):
        step = step_cls(self.pool, self.slots, num_active or self.num_active, use_triton=True)
        if overrides:
            step.replace_configs(lambda p, c: {**overrides.get("*", {}), **overrides.get(p, {})})
        return step

    def run(self, step, projs=None) -> None:
        for layer in range(self.shapes.num_layers):
            for p in projs or self.projs:
                step.add(layer, p, self.xs[p], self.outs[p])

    def bytes_needed(self, adapters: int, projs=None) -> tuple[int, int]:
        """(adapter weight bytes, activation bytes) one step must move: A and B of the adapters in use at their
        rank, x read and out read + written, every layer."""
        elem = torch.finfo(self.dtype).bits // 8
        weights = acts = 0
        for p in projs or self.projs:
            k, widths = self.shapes.proj_in(p), self.shapes.slice_widths(p)
            weights += adapters * self.rank * (len(widths) * k + sum(widths)) * elem
            acts += self.num_tokens * (k + 2 * sum(widths)) * elem
        return weights * self.shapes.num_layers, acts * self.shapes.num_layers


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Eager:
    """CPU stand-in for a captured graph (``--smoke``): replay runs the function."""

    def __init__(self, fn):
        self.replay = fn


def _capture(fn, device):
    if device.type != "cuda":
        fn()
        return _Eager(fn)
    from loraplex.kernels.lora_testing import capture_cuda_graph

    with torch.cuda.device(device):
        graph = capture_cuda_graph(fn)  # compiled and warmed up outside the capture
    for _ in range(3):
        graph.replay()
    return graph


def _replay_seconds(graph, reps: int) -> float:
    if isinstance(graph, _Eager):
        times = []
        for _ in range(max(1, reps // 20)):
            start = time.perf_counter()
            graph.replay()
            times.append(time.perf_counter() - start)
        return statistics.median(times)
    times = []
    for _ in range(reps):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _profile_kernels(graph) -> list[tuple[str, float, float]] | str:
    """(name, start us, duration us) of every kernel of one replay, in order (torch profiler / CUPTI); a string
    saying why when the profiler gives nothing."""
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            graph.replay()
            torch.cuda.synchronize()
        kernels = [(e.name, e.time_range.start, e.time_range.elapsed_us()) for e in prof.events()
                   if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
        kernels.sort(key=lambda k: k[1])
        return kernels or "the profiler recorded no kernel of the graph replay"
    except Exception as exc:  # a profiler that cannot trace graph kernels here: report, don't fail the run
        return f"profiler failed: {str(exc).splitlines()[0][:200]}"


def _kernel_table(kernels, bench: _DecodeStepBench, adapters: int, copy_bw: float) -> tuple[dict, list[dict]]:
    """Summary of one profiled replay and, per projection and LoRA kernel, the mean duration over the layers,
    the mean gap before it (previous kernel's end to its start) and the % of copy bandwidth of its bytes."""
    if isinstance(kernels, str):
        return {"profile_error": kernels}, []
    ends = [s + d for _, s, d in kernels]
    summary = {"kernels": len(kernels), "busy_us": sum(d for _, _, d in kernels),
               "span_us": ends[-1] - kernels[0][1],
               "kernel_names": sorted({n for n, _, _ in kernels})}
    kinds = {"_lora_shrink": "shrink", "_lora_expand": "expand", "_lora_ticketed": "shrink+expand"}
    lora = [(i, kind) for i, (n, _, _) in enumerate(kernels) for key, kind in kinds.items() if key in n]
    summary["setup_kernels"] = lora[0][0] if lora else len(kernels)  # metadata etc. before the first LoRA kernel
    summary["setup_us"] = (kernels[lora[0][0]][1] - kernels[0][1]) if lora else summary["span_us"]
    per = {}
    proj = 0  # the projection the next LoRA kernel serves: a shrink keeps it, an expand or a ticketed kernel ends it
    for i, kind in lora:
        p = bench.projs[proj % len(bench.projs)]
        proj += kind != "shrink"
        gap = kernels[i][1] - ends[i - 1] if i > 0 else 0.0
        per.setdefault((p, kind), []).append((kernels[i][2], gap))
    elem = torch.finfo(bench.dtype).bits // 8
    rows = []
    tokens = bench.num_tokens
    for (p, kind), vals in per.items():
        k, widths = bench.shapes.proj_in(p), bench.shapes.slice_widths(p)
        nbytes = 0
        if kind != "expand":
            nbytes += (adapters * len(widths) * bench.rank * k + tokens * k) * elem
        if kind != "shrink":
            nbytes += (adapters * bench.rank * sum(widths) + 2 * tokens * sum(widths)) * elem
        us = statistics.mean(v[0] for v in vals)
        rows.append({"proj": p, "kernel": kind, "launches": len(vals), "us": us,
                     "gap_us": statistics.mean(v[1] for v in vals), "bytes": nbytes,
                     "pct_copy_bw": 100 * nbytes / (us * 1e-6) / copy_bw})
    return summary, rows


def bench_decode_steps(shapes, num_tokens: int, rank: int, device, dtype, copy_bw: float, reps: int,
                       policies: dict, before_dir: str | None = None, profile: bool = True,
                       mixes=STEP_MIXES) -> dict:
    """All LoRA work of one decode step, three workloads (``STEP_MIXES``), per policy.

    policies: name -> config overrides for the current kernels ({} = defaults; {"*": {...}} for every
    projection, or per projection), plus ``before`` (the previous kernels, when ``before_dir`` holds a copy).
    Each policy's step is captured once, as the engine does, and replayed for each mix: ``time_ms`` (metadata
    built inside the graph, as in the engine) and ``adds_ms`` (metadata built outside, only the 256 LoRA
    launches: the method of the earlier 2.87 ms figure)."""
    from loraplex.adapters.mapping import LoRAStep

    bench = _DecodeStepBench(shapes, num_tokens, rank, device, dtype)
    before_cls = _before_step_class(before_dir)
    rows, kernel_rows = [], []
    for name, overrides in policies.items():
        step_cls = before_cls if name == "before" else LoRAStep
        if step_cls is None:
            log.warning("no copy of the previous kernels under %s: policy %s skipped", before_dir, name)
            continue
        ov = None if name == "before" else overrides
        bench.slots.copy_(_mix_slots(num_tokens, mixes[0][1], device))
        try:
            graph = _capture(lambda cls=step_cls, ov=ov: bench.run(bench.make_step(cls, ov)), device)
        except Exception as exc:
            log.warning("policy %s failed: %s", name, str(exc).splitlines()[0][:300])
            _sync(device)
            continue
        configs = {p: _config_summary(c) for p, c in bench.make_step(step_cls, ov)._configs.items()}
        for mix, adapters in mixes:
            adapters = min(adapters, num_tokens, bench.pool.max_loras)
            bench.slots.copy_(_mix_slots(num_tokens, adapters, device))
            _sync(device)
            seconds = _replay_seconds(graph, reps)
            step = bench.make_step(step_cls, ov)  # metadata of this mix, outside the graph
            adds = _capture(lambda step=step: bench.run(step), device)
            adds_s = _replay_seconds(adds, reps)
            del adds
            weights, acts = bench.bytes_needed(adapters)
            row = {"policy": name, "mix": mix, "adapters": adapters, "tokens": num_tokens, "rank": rank,
                   "layers": shapes.num_layers, "time_ms": seconds * 1e3, "adds_ms": adds_s * 1e3,
                   "lora_bytes": weights, "act_bytes": acts, "floor_ms": (weights + acts) / copy_bw * 1e3,
                   "pct_copy_bw": 100 * (weights + acts) / seconds / copy_bw, "target_ms": STEP_TARGET_MS,
                   "launches_planned": shapes.num_layers * sum(1 if c.get("ticketed") else 2 for c in configs.values()),
                   "configs": configs}
            if profile:
                summary, per_kernel = _kernel_table(_profile_kernels(graph), bench, adapters, copy_bw)
                row.update(summary)
                kernel_rows += [{"policy": name, "mix": mix, **r} for r in per_kernel]
            rows.append(row)
            log.info("STEP %s", {k: v for k, v in row.items() if k not in ("configs", "kernel_names")})
        del graph
    return {"tokens": num_tokens, "rank": rank, "layers": shapes.num_layers, "steps": rows, "kernels": kernel_rows}


# LoRA inside the base projections (bench_in_layer), as LoRAStep options: the shrink after the GEMM on the same
# stream, or on a forked stream alongside it (engine option lora_overlap_shrink), or the write-first order (shrink
# and a write-only expand, then the GEMM accumulating into that output: engine option lora_expand_first_min_tokens;
# every token carries an adapter in these mixes; "(graph)": the step does not know that, as a decode CUDA
# graph does not, so the expand's extra programs look for base rows to zero)
# ("cfg": overrides of every projection's kernel configuration, not a LoRAStep option)
IN_LAYER_POLICIES = (("sequential", {}), ("sequential, weights into L2", {"cfg": {"weight_prefetch": "l2"}}),
                     ("sequential, first weight tile", {"cfg": {"weight_prefetch": "first"}}),
                     ("overlap", {"overlap_shrink": True}),
                     ("expand-first", {"expand_first_min_tokens": 1, "has_base_tokens": False}),
                     ("expand-first (graph)", {"expand_first_min_tokens": 1, "has_base_tokens": True}),
                     ("gemm shrink", {"gemm_shrink": True}),
                     ("ticketed", {"cfg": {"ticketed": True}}))
# --smoke (the interpreter, where each policy costs a minute of CPU): one of each kind of order; the weight-prefetch
# forms are GPU-only (the interpreter drops the L2 form) and the overlap needs CUDA (on the CPU it is sequential)
SMOKE_IN_LAYER_POLICIES = ("sequential", "expand-first", "gemm shrink")


def _in_layer_step(bench, options: dict):
    from loraplex.adapters.mapping import LoRAStep

    options = dict(options)
    cfg = options.pop("cfg", None)
    step = LoRAStep(bench.pool, bench.slots, bench.num_active, True, **options)
    if cfg:
        step.replace_configs(lambda p, c: cfg)
    return step

# prefill-sized in-layer runs (--in-layer-tokens above the decode step's): adapters among the step's tokens
PREFILL_IN_LAYER_MIXES = (("32 adapters", 32), ("8 adapters", 8))
SMOKE_IN_LAYER_MIXES = (("8 adapters", 8), ("2 adapters", 2))


def bench_in_layer(shapes, num_tokens: int, rank: int, device, dtype, copy_bw: float, reps: int,
                   mixes=STEP_MIXES, num_slots: int | None = None, policies=None) -> dict:
    """The base projections of one step (32 layers x qkv, o, gate|up, down; random bf16 weights of the model's
    shapes, distinct per layer) with and without the LoRA work, each one CUDA graph built as the engine builds its
    graphs (LoRAStep inside the graph). ``added_ms`` = step with LoRA - base projections alone: what LoRA costs a
    step when its launches sit between the GEMMs, per policy (``IN_LAYER_POLICIES``). ``num_slots``: the pool's
    slots (default one per token: a decode step's distinct adapters). With the ``gemm shrink`` policy every projection's
    weights are folded with the pool's A rows (``SlotPool.fold_base_weights``) and the other policies use the base
    rows, views of the same tensors. ``policies``: names of ``IN_LAYER_POLICIES`` to run (default all)."""

    bench = _DecodeStepBench(shapes, num_tokens, rank, device, dtype, num_slots=num_slots)
    gen = torch.Generator(device=device).manual_seed(1)
    weights = [{p: torch.empty(sum(shapes.slice_widths(p)), shapes.proj_in(p), dtype=dtype, device=device)
                .normal_(0.0, 0.02, generator=gen) for p in bench.projs} for _ in range(shapes.num_layers)]
    elem = torch.finfo(dtype).bits // 8
    base_bytes = sum(w.numel() for layer in weights for w in layer.values()) * elem
    if policies is None or "gemm shrink" in policies:
        for p in bench.projs:
            views = bench.pool.fold_base_weights(p, [layer[p] for layer in weights])
            for layer, view in zip(weights, views):
                layer[p] = view

    def run(step) -> None:
        for layer in range(shapes.num_layers):
            for p in bench.projs:
                if step is None:
                    torch.nn.functional.linear(bench.xs[p], weights[layer][p])
                else:
                    step.linear(layer, p, bench.xs[p], weights[layer][p])

    graph = _capture(lambda: run(None), device)
    base_s = _replay_seconds(graph, reps)
    del graph
    rows = [{"policy": "base only", "mix": "—", "adapters": 0, "time_ms": base_s * 1e3, "added_ms": 0.0,
             "base_floor_ms": base_bytes / copy_bw * 1e3, "lora_floor_ms": 0.0}]
    log.info("IN-LAYER %s", rows[-1])
    for name, options in IN_LAYER_POLICIES:
        if policies is not None and name not in policies:
            continue
        bench.slots.copy_(_mix_slots(num_tokens, mixes[0][1], device))
        try:
            graph = _capture(lambda options=options: run(_in_layer_step(bench, options)), device)
        except Exception as exc:  # report the failure, keep the rest of the run
            log.warning("in-layer policy %s failed: %s", name, str(exc).splitlines()[0][:300])
            _sync(device)
            continue
        for mix, adapters in mixes:
            adapters = min(adapters, num_tokens, bench.pool.max_loras)
            bench.slots.copy_(_mix_slots(num_tokens, adapters, device))
            _sync(device)
            seconds = _replay_seconds(graph, reps)
            lora_w, acts = bench.bytes_needed(adapters)
            rows.append({"policy": name, "mix": mix, "adapters": adapters, "time_ms": seconds * 1e3,
                         "added_ms": (seconds - base_s) * 1e3, "base_floor_ms": base_bytes / copy_bw * 1e3,
                         "lora_floor_ms": (lora_w + acts) / copy_bw * 1e3})
            log.info("IN-LAYER %s", rows[-1])
        del graph
    return {"tokens": num_tokens, "rank": rank, "layers": shapes.num_layers, "slots": bench.pool.max_loras,
            "rows": rows}


def _in_layer_markdown(in_layer: dict | None) -> list[str]:
    if not in_layer:
        return []
    lines = [f"## LoRA inside the base projections of one step of {in_layer['tokens']} tokens", "",
             f"{in_layer['tokens']} tokens, rank {in_layer['rank']}, {in_layer.get('slots', '?')} slots, "
             f"{in_layer['layers']} layers x (q|k|v, o, gate|up, down): the base GEMMs (random weights of the model's shapes) with the LoRA work between them, one CUDA "
             "graph each, median replay. Added = with LoRA - base projections alone. `overlap`: each shrink on a "
             "forked stream while its GEMM runs (engine option `lora_overlap_shrink`); `sequential`: after it; "
             "`expand-first`: shrink and a write-only expand, then the GEMM accumulating into that output (engine "
             "option `lora_expand_first_min_tokens`); `gemm shrink`: every slot's A rows folded under the base weight, "
             "one cuBLAS GEMM gives the base output and every slot's y, then the expand (engine option "
             "`lora_gemm_shrink`; it reads every slot's A whatever the step uses).", "",
             "| policy | workload | adapters | time (ms) | added by LoRA (ms) | LoRA floor (ms) | base floor (ms) |",
             "|---|---|---|---|---|---|---|"]
    for r in in_layer["rows"]:
        lines.append(f"| {r['policy']} | {r['mix']} | {r['adapters']} | {r['time_ms']:.3f} | {r['added_ms']:.3f} | "
                     f"{r['lora_floor_ms']:.3f} | {r['base_floor_ms']:.3f} |")
    return lines + [""]


# whole-step policies of the default run: the previous kernels, the current defaults, and the current kernels with
# one change each (attribution); "run-A" = the defaults of the first H200 run of these kernels (run D in
# NOTES-lora.md: no per-chunk tables, gate|up expand tile 128, down at most 16 K parts)
STEP_POLICIES = {"before": None, "default": {}, "no-pdl": {"*": {"pdl": False}},
                 "weight-prefetch-l2": {"*": {"weight_prefetch": "l2"}},
                 "weight-prefetch-first": {"*": {"weight_prefetch": "first"}},
                 "no-chunk-tables": {"*": {"chunk_tables": False}},
                 "run-A": {"*": {"chunk_tables": False}, "gate_up": {"block_n": 128}, "down": {"split_k_max": 16}},
                 # one launch per projection (lora_ticketed), with the expand's warps (4) or the shrink's (2), and
                 # without programmatic dependent launch
                 "ticketed": {"*": {"ticketed": True}}, "ticketed-w2": {"*": {"ticketed": True, "ticket_warps": 2}},
                 "ticketed-no-pdl": {"*": {"ticketed": True, "pdl": False}}}


# configuration changes tried per projection by --step-variants (relative to the default configuration);
# "shrink" ones change only the shrink launch, "expand" ones only the expand
STEP_VARIANTS = (
    ("default", "both", {}),
    ("no-pdl", "both", {"pdl": False}),
    ("no-prefetch", "expand", {"prefetch_out": False}),
    ("wpf-l2", "both", {"weight_prefetch": "l2"}),  # A and B shares into L2 before the PDL wait
    ("wpf-first", "both", {"weight_prefetch": "first"}),  # their first tile into registers before it
    ("bn256", "expand", {"block_n": 256}),
    ("bn256-w8", "expand", {"block_n": 256, "expand_warps": 8}),
    ("en-x2", "expand", "expand_splits*2"),
    ("en-/2", "expand", "expand_splits/2"),
    ("sk-x2", "shrink", "split_k*2"),
    ("sk-/2", "shrink", "split_k/2"),
    ("bk256", "shrink", {"block_k": 256}),
    ("sw4", "shrink", {"shrink_warps": 4}),
    ("skmax8", "both", {"split_k_max": 8}),  # fewer K parts when few chunks are in use (fewer y partials to sum)
)


def _variant_overrides(change, cfg) -> dict:
    if isinstance(change, dict):
        return change
    field, op = change[:-2], change[-2:]
    value = getattr(cfg, field)
    value = value * 2 if op == "*2" else max(1, value // 2)
    if field == "split_k":
        return {"split_k": min(value, cfg.split_k_max or value)}
    return {field: value}


def step_variants(shapes, num_tokens: int, rank: int, device, dtype, copy_bw: float, reps: int,
                  before_dir: str | None = None) -> dict:
    """Per projection (its 32 layers in one CUDA graph, tiles planned as the engine does) and per workload, the
    time of each ``STEP_VARIANTS`` change; per projection the best shrink change and the best expand change
    (by the sum over the three workloads) are combined; then whole steps: before, default, the combination."""
    from loraplex.adapters.mapping import LoRAStep

    bench = _DecodeStepBench(shapes, num_tokens, rank, device, dtype)
    before_cls = _before_step_class(before_dir)
    groups, chosen = [], {}
    for p in bench.projs:
        base = bench.make_step(LoRAStep)._configs[p]
        results = []  # (name, kind, overrides, {mix: us per layer})
        cands = [(n, k, _variant_overrides(c, base)) for n, k, c in STEP_VARIANTS]
        if before_cls is not None:
            cands.insert(0, ("before", "both", None))
        for name, kind, ov in cands:
            times = {}
            for mix, adapters in STEP_MIXES:
                bench.slots.copy_(_mix_slots(num_tokens, adapters, device))
                try:
                    if name == "before":
                        step = bench.make_step(before_cls)
                    else:
                        step = bench.make_step(LoRAStep, {p: ov})
                    graph = _capture(lambda step=step, p=p: bench.run(step, (p,)), device)
                    times[mix] = _replay_seconds(graph, reps) / shapes.num_layers * 1e6
                    del graph
                except Exception as exc:
                    log.warning("%s %s %s failed: %s", p, name, mix, str(exc).splitlines()[0][:300])
                    _sync(device)
            if len(times) != len(STEP_MIXES):
                continue
            results.append((name, kind, ov, times))
            weights, acts = bench.bytes_needed(min(STEP_MIXES[0][1], num_tokens), (p,))
            groups.append({"proj": p, "variant": name, "overrides": ov, **{f"us_{m}": t for m, t in times.items()},
                           "pct_copy_bw_distinct": 100 * (weights + acts) / shapes.num_layers
                           / (times[STEP_MIXES[0][0]] * 1e-6) / copy_bw})
            log.info("VARIANT %s", groups[-1])
        score = {r[0]: sum(r[3].values()) for r in results}
        new = [r for r in results if r[0] != "before"]
        if not any(r[0] == "default" for r in new):
            continue
        best_shrink = min((r for r in new if r[1] == "shrink" or r[0] == "default"), key=lambda r: score[r[0]])
        best_expand = min((r for r in new if r[1] == "expand" or r[0] == "default"), key=lambda r: score[r[0]])
        combo = {**best_shrink[2], **best_expand[2]}
        for name, kind, ov, _ in new:  # whole-launch changes (pdl off, fewer K parts) that beat the default
            if kind == "both" and name != "default" and score[name] < score["default"]:
                combo.update(ov)
        chosen[p] = combo
        log.info("CHOSEN %s %s (shrink %s, expand %s)", p, combo, best_shrink[0], best_expand[0])
    policies = {"before": None, "default": {}, "no-pdl": {"*": {"pdl": False}}, "combo": chosen}
    bench.pool = bench.xs = bench.outs = None  # the step bench below allocates its own
    torch.cuda.empty_cache()
    steps = bench_decode_steps(shapes, num_tokens, rank, device, dtype, copy_bw, reps, policies, before_dir)
    return {"groups": groups, "chosen": chosen, **steps}


PREFILL_POLICIES = (("before", None), ("default", {}), ("no-prefetch", {"*": {"prefetch_out": False}}),
                    ("no-pdl", {"*": {"pdl": False}}))


def prefill_check(shapes, device, dtype, copy_bw: float, reps: int, before_dir: str | None,
                  num_tokens: int = 8192, adapters: int = 8, rank: int = 16) -> list[dict]:
    """Prefill regime (8,192 tokens on 8 adapters, equal runs): per projection, all layers in one CUDA graph, the
    previous kernels against the current ones and two variants of them (metadata outside the graph)."""
    from loraplex.adapters.mapping import LoRAStep

    bench = _DecodeStepBench(shapes, num_tokens, rank, device, dtype, num_slots=adapters)
    bench.slots.copy_(_mix_slots(num_tokens, adapters, device))
    before_cls = _before_step_class(before_dir)
    rows = []
    for p in bench.projs:
        weights, acts = bench.bytes_needed(adapters, (p,))
        for name, ov in PREFILL_POLICIES:
            cls = before_cls if name == "before" else LoRAStep
            if cls is None:
                continue
            step = bench.make_step(cls, ov, num_active=adapters)
            graph = _capture(lambda step=step, p=p: bench.run(step, (p,)), device)
            us = _replay_seconds(graph, reps) / shapes.num_layers * 1e6
            del graph
            rows.append({"proj": p, "policy": name, "tokens": num_tokens, "adapters": adapters, "rank": rank,
                         "us_per_layer": us, "bytes_per_layer": (weights + acts) / shapes.num_layers,
                         "pct_copy_bw": 100 * (weights + acts) / shapes.num_layers / (us * 1e-6) / copy_bw})
            log.info("PREFILL %s", rows[-1])
    return rows


def _graph_seconds(fn, device, reps: int) -> float:
    """Median seconds of one replay of a CUDA graph of ``fn`` (no host launch cost in the figure)."""
    if device.type != "cuda":
        return _median_seconds(fn, device, reps)
    return _replay_seconds(_capture(fn, device), reps)


def _two_launch_summary(cfg) -> dict:
    return {k: getattr(cfg, k) for k in ("split_k", "block_k", "shrink_warps", "shrink_stages", "expand_splits",
                                         "block_n", "expand_warps")}


def _two_launch_variants(base, k_dim: int, max_slice_width: int) -> tuple[list, list]:
    """Shrink variants (expand as in ``base``) and expand variants (shrink as in ``base``)."""
    shrink = [(f"sk{sk}-bk{bk}-w{w}", dataclasses.replace(base, split_k=sk, block_k=bk, shrink_warps=w))
              for sk in (2, 4, 8, 16) for bk in (128, 256) for w in (2, 4) if k_dim >= sk * bk]
    tiles = -(-max_slice_width // 128)
    expand = [(f"en{ns}-bn{bn}", dataclasses.replace(base, expand_splits=ns, block_n=bn))
              for ns in (1, 2, 4, 8, 16, 32) for bn in (128, 256) if ns <= -(-tiles * 128 // bn)]
    return shrink, expand


def step_sweep(shapes, num_tokens: int, ranks, device, dtype, copy_bw: float, reps: int,
               mode: str = "fused") -> dict:
    """Each projection's launches over all layers as one CUDA graph (as the engine runs them: no host launch
    cost, distinct weights per layer so nothing is served from L2 across layers), for the two-launch path
    and fused configurations; then the whole step with the fastest configuration per projection."""
    from loraplex.adapters.mapping import LoRAStep
    from loraplex.adapters.modules import PROJ_MODULES
    from loraplex.adapters.slot_pool import SlotPool
    from loraplex.kernels.lora_ops import lora_apply

    elem = torch.finfo(dtype).bits // 8
    result = {"tokens": num_tokens, "adapters": num_tokens, "layers": shapes.num_layers, "groups": [], "steps": []}
    best_r16: dict = {}
    fastest: dict = {}
    def one_rank(rank: int) -> None:
        pool = SlotPool(shapes, num_tokens, rank, device, dtype)
        gen = torch.Generator(device=device).manual_seed(rank)
        for t in (*pool.a.values(), *pool.bt.values()):
            t.normal_(0.0, 0.02, generator=gen)
        pool.ranks.fill_(rank)
        pool.scaling.fill_(2.0)
        step = LoRAStep(pool, torch.arange(num_tokens, dtype=torch.int32, device=device), num_tokens, True)
        scratch = torch.empty(16, 3, num_tokens, rank, dtype=torch.float32, device=device)
        xs = {p: torch.randn(num_tokens, shapes.proj_in(p), dtype=dtype, device=device) for p in PROJ_MODULES}
        outs = {p: torch.randn(num_tokens, sum(shapes.slice_widths(p)), dtype=dtype, device=device)
                for p in PROJ_MODULES}

        def run_group(p, cfg):
            width = max(shapes.slice_widths(p))
            for layer in range(shapes.num_layers):
                a, bt, rk = pool.layer_view(p, layer)
                lora_apply(xs[p], outs[p], a, bt, rk, pool.scaling, pool.slice_loc[p], width, step._meta, cfg,
                           scratch, step._counters, step._col_align[p])

        for p in PROJ_MODULES:
            base = step._configs[p]
            nbytes = (pool.a[p][0].numel() + pool.bt[p][0].numel()
                      + num_tokens * (xs[p].shape[1] + 2 * outs[p].shape[1])) * elem  # per layer
            base = dataclasses.replace(base, fused=False)
            cands = [("two-launch", base)]
            if rank == ranks[0] and mode == "two-launch":
                shrink_cands, expand_cands = _two_launch_variants(base, xs[p].shape[1], max(shapes.slice_widths(p)))
                cands += shrink_cands + expand_cands
            elif rank == ranks[0]:
                for tile in (256, 512, 1024):
                    for warps in (4, 8):
                        common = dict(fused=True, fused_block_k=tile, fused_block_n=tile, fused_warps=warps,
                                      fused_stages=3 if tile <= 256 else 2)
                        cands += [(f"ns{ns}", dataclasses.replace(base, fused_split_k=1, fused_n_splits=ns, **common))
                                  for ns in (1, 2, 4)]
                        cands += [(f"sk{sk}", dataclasses.replace(base, fused_split_k=sk, fused_n_splits=1, **common))
                                  for sk in (2, 4)]
            else:
                cands += [(name, c) for name, c, _ in best_r16.get(p, [])]
            rows = []
            for name, cfg in cands:
                try:
                    seconds = _graph_seconds(lambda p=p, cfg=cfg: run_group(p, cfg), device, reps) / shapes.num_layers
                except Exception as exc:  # a tile set over the shared-memory limit: skip it
                    log.warning("%s r%d %s %s failed: %s", p, rank, name, _fused_summary(cfg),
                                str(exc).splitlines()[0][:160])
                    _sync(device)
                    continue
                row = {"rank": rank, "proj": p, "variant": name,
                       "config": _fused_summary(cfg) if cfg.fused else _two_launch_summary(cfg),
                       "us_per_layer": seconds * 1e6,
                       "bytes_per_layer": nbytes, "pct_copy_bw": 100 * nbytes / seconds / copy_bw}
                rows.append((seconds, name, cfg, row))
                log.info("%s", row)
            if rank == ranks[0] and mode == "two-launch":
                # shrink and expand are separate launches: the best of each, measured together
                best_s = min((r for r in rows if r[1].startswith("sk") or r[1] == "two-launch"), key=lambda r: r[0])
                best_e = min((r for r in rows if r[1].startswith("en") or r[1] == "two-launch"), key=lambda r: r[0])
                combo = dataclasses.replace(best_s[2], expand_splits=best_e[2].expand_splits, block_n=best_e[2].block_n,
                                            expand_warps=best_e[2].expand_warps)
                seconds = _graph_seconds(lambda p=p, cfg=combo: run_group(p, cfg), device, reps) / shapes.num_layers
                row = {"rank": rank, "proj": p, "variant": "combo", "config": _two_launch_summary(combo),
                       "us_per_layer": seconds * 1e6, "bytes_per_layer": nbytes,
                       "pct_copy_bw": 100 * nbytes / seconds / copy_bw}
                rows.append((seconds, "combo", combo, row))
                log.info("%s", row)
            rows.sort(key=lambda r: r[0])
            fastest[(rank, p)] = rows[0][2]
            result["groups"] += [r[3] for r in rows]
            if rank == ranks[0]:
                best_r16[p] = [(n, c, s) for s, n, c, _ in rows if n != "two-launch"][:3]
        # whole step per policy: two-launch, and the fastest measured configuration per projection
        for policy in ("two-launch", "fastest"):
            cfgs = {}
            for p in PROJ_MODULES:
                if policy == "two-launch":
                    cfgs[p] = dataclasses.replace(step._configs[p], fused=False)
                else:
                    cfgs[p] = fastest[(rank, p)]

            def run_step(cfgs=cfgs):
                for layer in range(shapes.num_layers):
                    for p in PROJ_MODULES:
                        a, bt, rk = pool.layer_view(p, layer)
                        lora_apply(xs[p], outs[p], a, bt, rk, pool.scaling, pool.slice_loc[p],
                                   max(shapes.slice_widths(p)), step._meta, cfgs[p], scratch, step._counters,
                                   step._col_align[p])

            seconds = _graph_seconds(run_step, device, reps)
            lora_bytes = pool.num_bytes
            row = {"rank": rank, "policy": policy, "time_ms": seconds * 1e3, "lora_bytes": lora_bytes,
                   "floor_ms": lora_bytes / copy_bw * 1e3, "pct_copy_bw": 100 * lora_bytes / seconds / copy_bw,
                   "launches": shapes.num_layers * sum(1 if c.fused else 2 for c in cfgs.values()),
                   "configs": {p: _fused_summary(c) if c.fused else _two_launch_summary(c) for p, c in cfgs.items()}}
            result["steps"].append(row)
            log.info("STEP %s", row)
    for rank in ranks:
        one_rank(rank)
        torch.cuda.empty_cache()
    return result


def _step_sweep_markdown(payload: dict) -> str:
    sw = payload["step_sweep"]
    lines = [*markdown_head(f"LoRA decode step sweep ({payload['environment']['device_name']})", payload["command"]),
             f"Copy bandwidth: **{payload['copy_bandwidth_gb_s']:.0f} GB/s**. {sw['tokens']} tokens on "
             f"{sw['adapters']} distinct adapters, {sw['layers']} layers; every figure is a CUDA-graph replay.", "",
             "## Whole decode step (all 7 modules, all layers)", "",
             "| rank | policy | launches | time (ms) | floor (ms) | % copy BW | configs |", "|---|---|---|---|---|---|---|"]
    for r in sw["steps"]:
        lines.append(f"| {r['rank']} | {r['policy']} | {r['launches']} | {r['time_ms']:.3f} | {r['floor_ms']:.3f} | "
                     f"{r['pct_copy_bw']:.1f} | {json.dumps(r['configs'])} |")
    lines += ["", "## Per projection (all layers in one graph; time per layer, fastest first)", "",
              "| rank | proj | variant | us / layer | MB / layer | % copy BW | config |", "|---|---|---|---|---|---|---|"]
    for r in sw["groups"]:
        lines.append(f"| {r['rank']} | {r['proj']} | {r['variant']} | {r['us_per_layer']:.2f} | "
                     f"{r['bytes_per_layer'] / 1e6:.2f} | {r['pct_copy_bw']:.1f} | {json.dumps(r['config'])} |")
    lines.append("")
    return "\n".join(lines)


def _steps_markdown(steps: dict) -> list[str]:
    """Whole-step rows (per policy and workload) and the per-kernel table of the profiled replays."""
    lines = ["| policy | workload | adapters | time (ms) | LoRA launches only (ms) | kernels in the graph | "
             "GPU busy (us) | LoRA weights (MB) | floor (ms) | % copy BW |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in steps["steps"]:
        lines.append(f"| {r['policy']} | {r['mix']} | {r['adapters']} | {r['time_ms']:.3f} | {r['adds_ms']:.3f} | "
                     f"{r.get('kernels', '—')} | {r['busy_us']:.0f} | " if "busy_us" in r else
                     f"| {r['policy']} | {r['mix']} | {r['adapters']} | {r['time_ms']:.3f} | {r['adds_ms']:.3f} | — | — | ")
        lines[-1] += f"{r['lora_bytes'] / 1e6:.0f} | {r['floor_ms']:.3f} | {r['pct_copy_bw']:.1f} |"
    if steps.get("kernels"):
        lines += ["", "Per kernel inside the graph (torch profiler over one replay; mean over the 32 layers; gap = "
                  "previous kernel's end to this one's start; bytes = x or A, or B and out read + written, of the "
                  "adapters in use):", "",
                  "| policy | workload | proj | kernel | us | gap before (us) | MB | % copy BW |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in steps["kernels"]:
            lines.append(f"| {r['policy']} | {r['mix']} | {r['proj']} | {r['kernel']} | {r['us']:.2f} | "
                         f"{r['gap_us']:.2f} | {r['bytes'] / 1e6:.2f} | {r['pct_copy_bw']:.1f} |")
    errors = {r.get("profile_error") for r in steps["steps"] if r.get("profile_error")}
    lines += [f"Profiler: {e}" for e in sorted(errors)]
    return lines


STEPS_NOTE = ("Time (ms): median CUDA-graph replay of the whole step as the engine's decode graph runs it (LoRA "
              "metadata built on the device inside the graph; tiles planned for min(T, slots) distinct adapters "
              "whatever the workload). LoRA launches only: the same LoRA launches with the metadata built outside "
              "the graph (the method of the earlier 2.87 ms figure). Floor: LoRA weights of the adapters in use plus "
              "x and out (read + write) over the copy bandwidth. `before`: the previous kernels (a copy of their "
              "modules, same run).")


def _markdown(payload: dict) -> str:
    env = payload["environment"]
    lines = [*markdown_head(f"LoRA shrink/expand microbenchmark ({env['device_name']})", payload["command"]),
             f"Copy bandwidth (device-to-device, read + write): **{payload['copy_bandwidth_gb_s']:.0f} GB/s**. "
             f"Bytes: what each kernel must move at the adapters' real rank (x or y, A or B, out read + write).", ""]
    steps = payload.get("decode_steps")
    if steps:
        lines += ["## All LoRA work of one decode step", "",
                  f"{steps['tokens']} tokens, rank {steps['rank']} on all 7 modules, {steps['layers']} layers, one "
                  f"CUDA graph. {STEPS_NOTE}", ""] + _steps_markdown(steps) + [""]
    if payload.get("launch_floor"):
        from loraplex.bench import launch_floor

        lines += ["### The launch floor of that step", ""] + launch_floor.table_lines(payload["launch_floor"]) + [""]
    lines += _in_layer_markdown(payload.get("in_layer"))
    for more in payload.get("in_layer_more") or []:
        lines += _in_layer_markdown(more)
    lines += _prefill_markdown(payload.get("prefill"))
    lines += ["## Per kernel (do_bench: L2 flushed, host launch time partly inside the events)", "",
              "| regime | tokens | adapters | rank | proj | kernel | split-K | time (us) | MB | GB/s | % copy BW |"
              " sweep best (us) | best % copy BW | best config |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in payload["kernels"]:
        best = ("| — | — | " + (json.dumps(r["config"]) if "config" in r else "—") + " |" if "best_time_us" not in r else
                f"| {r['best_time_us']:.1f} | {r['best_pct_copy_bw']:.1f} | {json.dumps(r['best_config'])} |")
        lines.append(f"| {r['regime']} | {r['tokens']} | {r['adapters']} | {r['rank']} | {r['proj']} | "
                     f"{r['kernel']} | {r['split_k']} | {r['time_us']:.1f} | {r['bytes'] / 1e6:.2f} | "
                     f"{r['gb_s']:.0f} | {r['pct_copy_bw']:.1f} {best}")
    lines.append("")
    return "\n".join(lines)


def _variants_markdown(payload: dict) -> str:
    sv = payload["step_variants"]
    lines = [*markdown_head(f"LoRA decode step: launch variants per projection ({payload['environment']['device_name']})",
                            payload["command"]),
             f"Copy bandwidth: **{payload['copy_bandwidth_gb_s']:.0f} GB/s**. {sv['tokens']} tokens, rank {sv['rank']}, "
             f"{sv['layers']} layers; "
             "every figure a CUDA-graph replay.", "", "## Whole step", "", STEPS_NOTE, ""]
    lines += _steps_markdown(sv) + ["", "Per projection chosen (`combo`): " + json.dumps(sv["chosen"]), "",
                                    "## Per projection (its 32 layers in one graph; us per layer)", "",
                                    "| proj | variant | overrides | distinct | 8 adapters | identical | % copy BW (distinct) |",
                                    "|---|---|---|---|---|---|---|"]
    for r in sv["groups"]:
        lines.append(f"| {r['proj']} | {r['variant']} | {json.dumps(r['overrides'])} | {r['us_distinct']:.2f} | "
                     f"{r['us_8 adapters']:.2f} | {r['us_identical']:.2f} | {r['pct_copy_bw_distinct']:.1f} |")
    lines += [""] + _prefill_markdown(payload.get("prefill"))
    return "\n".join(lines)


def _prefill_markdown(rows) -> list[str]:
    if not rows:
        return []
    lines = ["## Prefill (8,192 tokens on 8 adapters, rank 16; all layers of one projection in one CUDA graph)", "",
             "| proj | policy | us / layer | MB / layer | % copy BW |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['proj']} | {r['policy']} | {r['us_per_layer']:.1f} | {r['bytes_per_layer'] / 1e6:.1f} | "
                     f"{r['pct_copy_bw']:.1f} |")
    return lines + [""]


def _use_interpreter() -> None:
    """CPU tensors need Triton's interpreter, chosen when a kernel is defined: (re)define ours under it."""
    os.environ["TRITON_INTERPRET"] = "1"
    from triton.runtime.interpreter import InterpretedFunction

    from loraplex.kernels import lora_expand, lora_fused, lora_meta, lora_shrink

    if not isinstance(lora_shrink._lora_shrink_kernel, InterpretedFunction):
        for module in (lora_meta, lora_shrink, lora_expand, lora_fused):
            importlib.reload(module)


def cuda_or_smoke(parser: argparse.ArgumentParser, smoke: bool) -> torch.device:
    """A kernel benchmark's device: CUDA, or with ``--smoke`` the CPU under Triton's interpreter (set up here);
    without CUDA and without ``--smoke``, a usage error."""
    device = torch.device("cuda" if torch.cuda.is_available() and not smoke else "cpu")
    if device.type != "cuda" and not smoke:
        parser.error("needs CUDA; use --smoke on the CPU (with TRITON_INTERPRET=1)")
    if smoke:
        _use_interpreter()
    return device


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loraplex.bench.lora_kernels", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="docs/benchmarks/lora_kernels_h200.json", help="JSON path (.md beside it)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU with TRITON_INTERPRET=1)")
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--reps", type=int, default=100, help="timed repetitions per figure")
    parser.add_argument("--sweep", action="store_true",
                        help="also try other fused configurations on the decode shapes, report the best, and time the "
                             "decode step with them")
    parser.add_argument("--sweep-two-launch", action="store_true",
                        help="with --sweep: also sweep the two-launch shrink / expand (slow: ~190 configs per shape)")
    parser.add_argument("--skip-prefill", action="store_true", help="decode shapes only")
    parser.add_argument("--in-layer-tokens", default="",
                        help="more token counts (comma-separated) for the in-layer benchmark, e.g. 8192: prefill-sized "
                             "steps with 32 and 8 adapters (the decode step's count always runs)")
    parser.add_argument("--in-layer-decode", default="",
                        help="more decode-step token counts (comma-separated, e.g. 256) for the in-layer benchmark, "
                             "one slot per token, distinct / 46 / 8 adapters (policies: see --in-layer-policies)")
    parser.add_argument("--in-layer-policies", default="",
                        help="comma-separated names of IN_LAYER_POLICIES for the in-layer runs at decode sizes (the "
                             "decode step's: default all, --smoke one of each order; --in-layer-decode's: default "
                             "sequential and gemm shrink)")
    parser.add_argument("--step-policies", default="",
                        help="comma-separated names of the decode-step policies to run, default among them "
                             f"(default all: {', '.join(STEP_POLICIES)})")
    parser.add_argument("--steps-only", action="store_true",
                        help="the decode-step policies and the in-layer run at the decode step's size, then stop")
    parser.add_argument("--in-layer-only", action="store_true",
                        help="only the in-layer benchmark (the decode step's and --in-layer-tokens)")
    parser.add_argument("--step-sweep-mode", choices=("fused", "two-launch"), default="fused",
                        help="with --step-sweep: which configurations to try at rank 16 (rank 64 tries the 3 best)")
    parser.add_argument("--step-variants", action="store_true",
                        help="only: decode steps (three workloads) before / after, per-projection launch variants "
                             "and their best combination, prefill before / after (CUDA graphs)")
    parser.add_argument("--before-dir", default=".lora_before",
                        help="folder holding lora_before/ (a copy of the previous kernel modules) for before/after")
    parser.add_argument("--no-profile", action="store_true", help="skip the per-kernel profile of the step graphs")
    parser.add_argument("--step-sweep", action="store_true",
                        help="only: per-projection and whole-step CUDA-graph timings of the two-launch path and fused "
                             "configurations (decode, 64 tokens on 64 adapters, ranks 16 and 64)")
    args = parser.parse_args(argv)
    chosen = tuple(p.strip() for p in args.in_layer_policies.split(",") if p.strip())
    unknown = set(chosen) - {name for name, _ in IN_LAYER_POLICIES}
    if unknown:
        parser.error(f"--in-layer-policies: unknown {', '.join(sorted(unknown))}; "
                     f"known: {', '.join(name for name, _ in IN_LAYER_POLICIES)}")
    step_names = [p.strip() for p in args.step_policies.split(",") if p.strip()]
    unknown = set(step_names) - set(STEP_POLICIES)
    if unknown:
        parser.error(f"--step-policies: unknown {', '.join(sorted(unknown))}; known: {', '.join(STEP_POLICIES)}")
    if step_names and "default" not in step_names:
        parser.error("--step-policies must include default: its distinct-adapter step is the report's target row")
    step_policies = {n: STEP_POLICIES[n] for n in step_names} if step_names else STEP_POLICIES
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from loraplex.adapters.modules import BaseShapes

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type != "cuda" and not args.smoke:
        parser.error("the full benchmark needs CUDA; use --smoke on the CPU (with TRITON_INTERPRET=1)")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # the interpreter has no bf16 dot
    if device.type != "cuda":
        _use_interpreter()
    if args.smoke:
        shapes, reps = BaseShapes.from_config(SMOKE), min(args.reps, 20)
        regimes, ranks, step_tokens, copy_bytes = [("decode", 8, 8), ("prefill", 96, 2)], [16], 8, 1 << 22
    else:
        shapes, reps = BaseShapes.from_config(LLAMA3_8B), args.reps
        regimes, ranks, step_tokens, copy_bytes = [("decode", 64, 64), ("prefill", 8192, 8)], [16, 64], 64, 1 << 30
    copy_bw = measure_copy_bandwidth(device, copy_bytes, iters=100)
    log.info("copy bandwidth %.0f GB/s", copy_bw / 1e9)
    if args.step_sweep:
        import triton

        sweep = step_sweep(shapes, step_tokens, [16, 64] if not args.smoke else [16], device, dtype, copy_bw, reps,
                           mode=args.step_sweep_mode)
        env = {"device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "torch": torch.__version__, "triton": triton.__version__, "dtype": str(dtype).replace("torch.", "")}
        payload = {"command": "python -m loraplex.bench.lora_kernels " + " ".join(
            shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)), "environment": env,
            "copy_bandwidth_gb_s": copy_bw / 1e9, "step_sweep": sweep}
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(payload, indent=2) + "\n")
        out.with_suffix(".md").write_text(_step_sweep_markdown(payload))
        log.info("wrote %s", out)
        return 0
    import triton

    env = {"device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)",
           "torch": torch.__version__, "triton": triton.__version__, "dtype": str(dtype).replace("torch.", "")}
    command = "python -m loraplex.bench.lora_kernels " + " ".join(shlex.quote(a) for a in
                                                                (sys.argv[1:] if argv is None else argv))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.step_variants:
        payload = {"command": command, "environment": env, "copy_bandwidth_gb_s": copy_bw / 1e9}
        payload["step_variants"] = step_variants(shapes, step_tokens, 16, device, dtype, copy_bw, reps, args.before_dir)
        out.write_text(json.dumps(payload, indent=2) + "\n")  # written twice: the prefill part may not finish
        if not args.skip_prefill:
            payload["prefill"] = prefill_check(shapes, device, dtype, copy_bw, max(5, reps // 5), args.before_dir,
                                               num_tokens=regimes[1][1], adapters=regimes[1][2])
        out.write_text(json.dumps(payload, indent=2) + "\n")
        out.with_suffix(".md").write_text(_variants_markdown(payload))
        log.info("wrote %s", out)
        return 0
    payload = {"command": command, "environment": env, "smoke": args.smoke, "shapes": dataclasses.asdict(shapes),
               "copy_bandwidth_gb_s": copy_bw / 1e9, "kernels": []}
    if not args.in_layer_only:
        steps = bench_decode_steps(shapes, step_tokens, 16, device, dtype, copy_bw, reps, step_policies,
                                   args.before_dir, profile=not args.no_profile and device.type == "cuda",
                                   mixes=STEP_MIXES if not args.smoke else (("distinct", 8), ("identical", 1)))
        default_distinct = next(r for r in steps["steps"] if r["policy"] == "default")
        payload["decode_steps"] = steps
        # the distinct-adapter step of the default policy (the issue-9 target row)
        payload["decode_step"] = {**default_distinct, "cuda_graph": device.type == "cuda"}
        if device.type == "cuda":
            torch.cuda.empty_cache()
        # the same launches with stand-in bodies: what this launch structure costs before it moves any bytes
        from loraplex.bench import launch_floor

        payload["launch_floor"] = launch_floor.run(shapes, step_tokens, 16, device, dtype, reps)

    def write() -> None:  # after each part: a run cut short still leaves what it measured
        out.write_text(json.dumps(payload, indent=2) + "\n")
        out.with_suffix(".md").write_text(_markdown(payload))

    write()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    smoke_policies = SMOKE_IN_LAYER_POLICIES if args.smoke else None
    payload["in_layer"] = bench_in_layer(shapes, step_tokens, 16, device, dtype, copy_bw, reps,
                                         mixes=STEP_MIXES if not args.smoke else (("distinct", 8), ("identical", 1)),
                                         policies=chosen or smoke_policies)
    write()
    for tokens in (int(t) for t in args.in_layer_decode.split(",") if t.strip()):
        # larger decode steps, one slot per token (the offline bench's distinct workload), few and many adapters
        if device.type == "cuda":
            torch.cuda.empty_cache()
        mixes = (("distinct", tokens), ("46 adapters", 46), ("8 adapters", 8)) if not args.smoke else (
            ("distinct", tokens), ("2 adapters", 2))
        payload.setdefault("in_layer_more", []).append(bench_in_layer(
            shapes, tokens, 16, device, dtype, copy_bw, reps, mixes=mixes, num_slots=tokens,
            policies=chosen or ("sequential", "gemm shrink")))
        write()
    if args.steps_only:
        log.info("wrote %s and %s", out, out.with_suffix(".md"))
        return 0
    for tokens in (int(t) for t in args.in_layer_tokens.split(",") if t.strip()):
        if device.type == "cuda":
            torch.cuda.empty_cache()
        mixes = PREFILL_IN_LAYER_MIXES if not args.smoke else SMOKE_IN_LAYER_MIXES  # (the interpreter's cost: programs)
        slots = max(a for _, a in mixes)
        payload.setdefault("in_layer_more", []).append(bench_in_layer(
            shapes, tokens, 16, device, dtype, copy_bw, max(1 if args.smoke else 3, reps // 10), mixes=mixes,
            num_slots=min(tokens, slots), policies=smoke_policies))
        write()
    if args.in_layer_only:
        log.info("wrote %s and %s", out, out.with_suffix(".md"))
        return 0
    if not args.skip_prefill and not args.smoke:
        payload["prefill"] = prefill_check(shapes, device, dtype, copy_bw, max(5, reps // 5), args.before_dir)
        write()
    if args.skip_prefill:
        regimes = [r for r in regimes if r[0] == "decode"]
    best_fused: dict = {}
    payload["kernels"] = bench_kernels(shapes, regimes, ranks, device, dtype, copy_bw, reps, args.sweep,
                                       args.sweep_two_launch, best_fused)
    write()
    log.info("wrote %s and %s", out, out.with_suffix(".md"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
