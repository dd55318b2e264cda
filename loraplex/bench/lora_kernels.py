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

from loraplex.bench.roofline import measure_copy_bandwidth

log = logging.getLogger(__name__)

LLAMA3_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
             "num_key_value_heads": 8, "head_dim": 128, "num_hidden_layers": 32}
SMOKE = {"hidden_size": 64, "intermediate_size": 176, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 16, "num_hidden_layers": 2}
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
    from loraplex.kernels.lora_shrink import lora_shrink

    meta = build_lora_meta(b.token_slots, b.lora_a.shape[0], cfg.block_m)
    shrink_kw = dict(split_k=cfg.split_k, block_r=cfg.block_r, block_k=cfg.block_k, num_warps=cfg.shrink_warps,
                     num_stages=cfg.shrink_stages)
    y = lora_shrink(b.x, b.lora_a, b.ranks, meta, **shrink_kw)
    width = b.max_slice_width

    def shrink():
        lora_shrink(b.x, b.lora_a, b.ranks, meta, y=y, **shrink_kw)

    align = slice_col_align(b.slice_loc.tolist())  # host copy, outside any timing

    def expand():
        lora_expand(y, b.lora_b, b.ranks, b.scaling, b.slice_loc, width, meta, b.out, block_n=cfg.block_n,
                    n_splits=cfg.expand_splits, num_warps=cfg.expand_warps, num_stages=cfg.expand_stages,
                    col_align=align)

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

    elem = torch.finfo(dtype).bits // 8
    b = _pool_case(shapes, proj, num_tokens, num_adapters, rank, device, dtype, seed=rank)
    k_dim, n_total, num_slices = b.x.shape[1], b.out.shape[1], len(b.slice_loc) - 1
    cfg = choose_config(num_tokens, num_adapters, num_adapters, rank, k_dim, num_slices, b.max_slice_width)
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


def bench_decode_step(shapes, num_tokens: int, rank: int, device, dtype, copy_bw: float, reps: int,
                      policy: str = "default", configs: dict | None = None) -> dict:
    """All LoRA work of one decode step through LoRAStep.add, one adapter per token, replayed as a CUDA graph.

    policy: ``default`` (choose_config), ``two-launch`` (shrink + expand per projection, the pre-fusion
    path) or ``swept`` (``configs``: the fastest fused configuration measured per projection).
    """
    from loraplex.adapters.mapping import LoRAStep
    from loraplex.adapters.modules import PROJ_MODULES
    from loraplex.adapters.slot_pool import SlotPool

    pool = SlotPool(shapes, num_tokens, rank, device, dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    for t in (*pool.a.values(), *pool.bt.values()):
        t.normal_(0.0, 0.02, generator=gen)
    pool.ranks.fill_(rank)
    pool.scaling.fill_(2.0)
    token_slots = torch.arange(num_tokens, dtype=torch.int32, device=device)
    step = LoRAStep(pool, token_slots, num_tokens, use_triton=True)
    if policy == "two-launch":
        step._configs = {p: dataclasses.replace(c, fused=False) for p, c in step._configs.items()}
    elif policy == "swept":
        step._configs = {p: dataclasses.replace(step._configs[p], **_fused_summary(configs[p]), fused=True)
                         if p in configs else step._configs[p] for p in step._configs}
        need = max(c.fused_split_k for c in step._configs.values())
        if need > step._scratch.shape[0]:
            step._scratch = torch.empty(need, *step._scratch.shape[1:], dtype=torch.float32, device=device)
    xs = {p: torch.randn(num_tokens, shapes.proj_in(p), dtype=dtype, device=device) for p in PROJ_MODULES}
    outs = {p: torch.randn(num_tokens, sum(shapes.slice_widths(p)), dtype=dtype, device=device)
            for p in PROJ_MODULES}

    def run_step():
        for layer in range(shapes.num_layers):
            for p in PROJ_MODULES:
                step.add(layer, p, xs[p], outs[p])

    elem = torch.finfo(dtype).bits // 8
    lora_bytes = sum(t.numel() for t in (*pool.a.values(), *pool.bt.values())) * elem  # every slot is active
    per_layer = sum(1 if c.fused else 2 for c in step._configs.values())
    result = {"policy": policy, "configs": {p: _fused_summary(c) if c.fused else "two-launch"
                                            for p, c in step._configs.items()},
              "tokens": num_tokens, "adapters": num_tokens, "rank": rank, "layers": shapes.num_layers,
              "launches": per_layer * shapes.num_layers, "lora_bytes": lora_bytes,
              "floor_ms": lora_bytes / copy_bw * 1e3, "target_ms": STEP_TARGET_MS}
    seconds = _graph_seconds(run_step, device, reps)  # one CUDA-graph replay on the GPU
    result["cuda_graph"] = device.type == "cuda"
    result.update(time_ms=seconds * 1e3, gb_s=lora_bytes / seconds / 1e9,
                  pct_copy_bw=100 * lora_bytes / seconds / copy_bw)
    return result


def _graph_seconds(fn, device, reps: int) -> float:
    """Median seconds of one replay of a CUDA graph of ``fn`` (no host launch cost in the figure)."""
    if device.type != "cuda":
        return _median_seconds(fn, device, reps)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn()  # compile and warm up outside the capture
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(reps):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) / 1e3)
    return statistics.median(times)


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
                    torch.cuda.synchronize()
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
    lines = [f"# LoRA decode step sweep ({payload['environment']['device_name']})", "", "Command:", "", "```",
             payload["command"], "```", "",
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


def _markdown(payload: dict) -> str:
    env, step = payload["environment"], payload["decode_step"]
    lines = [f"# LoRA shrink/expand microbenchmark ({env['device_name']})", "", "Command:", "", "```",
             payload["command"], "```", "",
             f"Copy bandwidth (device-to-device, read + write): **{payload['copy_bandwidth_gb_s']:.0f} GB/s**. "
             f"Bytes: what each kernel must move at the adapters' real rank (x or y, A or B, out read + write).",
             "", "| regime | tokens | adapters | rank | proj | kernel | split-K | time (us) | MB | GB/s | % copy BW |"
             " sweep best (us) | best % copy BW | best config |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in payload["kernels"]:
        best = ("| — | — | " + (json.dumps(r["config"]) if "config" in r else "—") + " |" if "best_time_us" not in r else
                f"| {r['best_time_us']:.1f} | {r['best_pct_copy_bw']:.1f} | {json.dumps(r['best_config'])} |")
        lines.append(f"| {r['regime']} | {r['tokens']} | {r['adapters']} | {r['rank']} | {r['proj']} | "
                     f"{r['kernel']} | {r['split_k']} | {r['time_us']:.1f} | {r['bytes'] / 1e6:.2f} | "
                     f"{r['gb_s']:.0f} | {r['pct_copy_bw']:.1f} {best}")
    lines += ["", "Fused rows (decode): one launch doing shrink + expand; `two_launch_us` = shrink + expand above; "
              "config = split-K (last-arriver expand) or column splits.", "",
              "## All LoRA work of one decode step", "",
              f"{step['tokens']} tokens on {step['adapters']} distinct rank-{step['rank']} adapters, "
              f"{step['layers']} layers x q|k|v, o, gate|up, down{', one CUDA graph' if step['cuda_graph'] else ''}:",
              "", "| policy | launches | time (ms) | LoRA bytes (GB) | bandwidth floor (ms) | target (ms) | GB/s |"
              " % copy BW | configs |", "|---|---|---|---|---|---|---|---|---|"]
    for st in [step, *payload.get("decode_step_variants", [])]:
        lines.append(f"| {st.get('policy', 'default')} | {st['launches']} | {st['time_ms']:.3f} | "
                     f"{st['lora_bytes'] / 1e9:.2f} | {st['floor_ms']:.3f} | {st['target_ms']:.1f} | {st['gb_s']:.0f} | "
                     f"{st['pct_copy_bw']:.1f} | {json.dumps(st.get('configs', ''))} |")
    lines.append("")
    return "\n".join(lines)


def _use_interpreter() -> None:
    """CPU tensors need Triton's interpreter, chosen when a kernel is defined: (re)define ours under it."""
    os.environ["TRITON_INTERPRET"] = "1"
    from triton.runtime.interpreter import InterpretedFunction

    from loraplex.kernels import lora_expand, lora_fused, lora_shrink

    if not isinstance(lora_shrink._lora_shrink_kernel, InterpretedFunction):
        for module in (lora_shrink, lora_expand, lora_fused):
            importlib.reload(module)


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
    parser.add_argument("--step-sweep-mode", choices=("fused", "two-launch"), default="fused",
                        help="with --step-sweep: which configurations to try at rank 16 (rank 64 tries the 3 best)")
    parser.add_argument("--step-sweep", action="store_true",
                        help="only: per-projection and whole-step CUDA-graph timings of the two-launch path and fused "
                             "configurations (decode, 64 tokens on 64 adapters, ranks 16 and 64)")
    args = parser.parse_args(argv)
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
    if args.skip_prefill:
        regimes = [r for r in regimes if r[0] == "decode"]
    best_fused: dict = {}
    kernels = bench_kernels(shapes, regimes, ranks, device, dtype, copy_bw, reps, args.sweep, args.sweep_two_launch,
                            best_fused)
    step = bench_decode_step(shapes, step_tokens, 16, device, dtype, copy_bw, reps)
    log.info("decode step: %s", step)
    variants = [bench_decode_step(shapes, step_tokens, 16, device, dtype, copy_bw, reps, policy="two-launch")]
    swept = {proj: c for (rank, proj), c in best_fused.items() if rank == 16}
    if swept:
        variants.append(bench_decode_step(shapes, step_tokens, 16, device, dtype, copy_bw, reps, policy="swept",
                                          configs=swept))
    for v in variants:
        log.info("decode step (%s): %s", v["policy"], v)
    import triton

    env = {"device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)",
           "torch": torch.__version__, "triton": triton.__version__, "dtype": str(dtype).replace("torch.", "")}
    payload = {"command": "python -m loraplex.bench.lora_kernels " + " ".join(shlex.quote(a) for a in
                                                                            (sys.argv[1:] if argv is None else argv)),
               "environment": env, "smoke": args.smoke, "shapes": dataclasses.asdict(shapes),
               "copy_bandwidth_gb_s": copy_bw / 1e9, "kernels": kernels, "decode_step": step,
               "decode_step_variants": variants}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2) + "\n")
    out.with_suffix(".md").write_text(_markdown(payload))
    log.info("wrote %s and %s", out, out.with_suffix(".md"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
