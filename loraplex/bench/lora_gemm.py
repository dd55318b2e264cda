"""The LoRA expand inside the base GEMM (``kernels/lora_gemm.py``) against cuBLAS + shrink + expand, on decode shapes.

Per projection of the Llama-3-8B shape (q|k|v, o, gate|up, down), at ``--tokens`` tokens on distinct rank-16
adapters, all 32 layers (distinct weights per layer, so nothing is served from L2 across layers) in one CUDA graph,
median replay, time per layer:

- ``cuBLAS``: the base projection alone (``F.linear``), the reference every other row is compared with;
- ``cuBLAS + shrink + expand``: the engine's usual LoRA path (``LoRAStep.linear``);
- ``Triton GEMM``: ``gemm_lora`` without adapters, for each launch configuration tried (column tile, K tile, warps,
  stages): what the Triton GEMM costs against cuBLAS;
- ``shrink + fused GEMM``: ``LoRAStep.linear`` with ``fused_gemm_max_tokens`` for the fastest few of those.

Then, with the fastest fused configuration per projection, the whole step as the in-layer benchmark runs it
(``lora_kernels.bench_in_layer``: 32 layers x 4 projections in one graph; distinct, 8 adapters, identical), and the
fused path's error against an fp32 reference next to the usual path's. Writes JSON and a markdown table.
"""

from __future__ import annotations

import argparse
import logging
import time

import torch
import torch.nn.functional as F

from loraplex.bench.lora_kernels import (
    STEP_MIXES,
    _capture,
    _replay_seconds,
    _sync,
    _use_interpreter,
)
from loraplex.bench.report import environment, markdown_head, module_command, write_json_and_markdown

log = logging.getLogger(__name__)

# launch configurations tried per projection: every column tile that fits x these (BLOCK_K, warps, stages)
SWEEP = tuple((bk, w, s) for bk in (128, 256) for w, s in ((4, 3), (4, 4), (8, 4)))
SMOKE_SWEEP = ((32, 4, 1),)
FUSED_TOP = 3  # fastest Triton GEMM configurations also timed with the LoRA epilogue


def _candidates(m: int, n: int, widths, sweep, bms=None) -> list[tuple[int, ...]]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages): every column tile that fits x ``sweep`` (BLOCK_K, warps, stages),
    at the row tile the policy picks for ``m`` or at each of ``bms``."""
    from loraplex.kernels.lora_gemm import choose_gemm_blocks

    bms = bms or (choose_gemm_blocks(m, n, 0, widths)[0],)
    fits = [bn for bn in (16, 32, 64, 128) if n % bn == 0 and all(w % bn == 0 for w in widths)]
    return [(bm, bn, bk, w, s) for bm in bms for bn in fits for bk, w, s in sweep]


def bench_projection(shapes, proj: str, pool, slots, num_tokens: int, device, dtype, copy_bw: float, reps: int,
                     sweep, bms=None) -> dict:
    from loraplex.adapters.mapping import LoRAStep
    from loraplex.kernels import lora_gemm
    from loraplex.kernels.lora_gemm import choose_gemm_blocks, gemm_lora

    widths = tuple(shapes.slice_widths(proj))
    n, k = sum(widths), shapes.proj_in(proj)
    gen = torch.Generator(device=device).manual_seed(7)
    weights = [torch.empty(n, k, dtype=dtype, device=device).normal_(0.0, k ** -0.5, generator=gen)
               for _ in range(shapes.num_layers)]
    x = torch.randn(num_tokens, k, dtype=dtype, device=device, generator=gen)
    elem = torch.finfo(dtype).bits // 8
    base_bytes = (n * k + num_tokens * (k + n)) * elem
    active = int(torch.unique(slots[slots >= 0]).numel())
    lora_bytes = active * pool.max_rank * (len(widths) * k + n) * elem
    rows = []

    def timed(name: str, fn, config=None) -> float | None:
        try:
            graph = _capture(fn, device)
            seconds = _replay_seconds(graph, reps) / shapes.num_layers
            del graph
        except Exception as exc:  # a configuration that does not compile or launch: reported, the run goes on
            log.warning("%s %s %s failed: %s", proj, name, config, str(exc).splitlines()[0][:200])
            _sync(device)
            return None
        rows.append({"proj": proj, "variant": name, "config": list(config) if config else None,
                     "us_per_layer": seconds * 1e6,
                     "pct_copy_bw": (base_bytes + (lora_bytes if "shrink" in name else 0)) / seconds / copy_bw * 100})
        log.info("GEMM %s", rows[-1])
        return seconds

    def layers(fn):
        return lambda: [fn(layer, weights[layer]) for layer in range(shapes.num_layers)]

    cublas = timed("cuBLAS", layers(lambda i, w: F.linear(x, w)))
    usual_step = LoRAStep(pool, slots, active, True)
    usual = timed("cuBLAS + shrink + expand", layers(lambda i, w: usual_step.linear(i, proj, x, w)))
    triton_times = []
    for blocks in _candidates(num_tokens, n, widths, sweep, bms):
        s = timed("Triton GEMM", layers(lambda i, w, b=blocks: gemm_lora(x, w, None, None, slice_widths=widths,
                                                                       blocks=b)), blocks)
        if s is not None:
            triton_times.append((s, blocks))
    triton_times.sort()
    default_blocks = choose_gemm_blocks(num_tokens, n, k, widths)
    tried = [b for _, b in triton_times[:FUSED_TOP]]
    if default_blocks not in tried:
        tried.append(default_blocks)
    fused = []
    for blocks in tried:
        step = LoRAStep(pool, slots, active, True, fused_gemm_max_tokens=num_tokens)
        step._gemm_blocks[proj] = (n, k, blocks)
        s = timed("shrink + fused GEMM", layers(lambda i, w, st=step: st.linear(i, proj, x, w)), blocks)
        if s is not None:
            fused.append((s, blocks))
    fused.sort()
    best = fused[0][1] if fused else None
    no_overlap = None
    if best is not None and lora_gemm.OVERLAP_SHRINK:  # the same, the GEMM's main loop after the shrink (PDL wait first)
        lora_gemm.OVERLAP_SHRINK = False
        try:
            step = LoRAStep(pool, slots, active, True, fused_gemm_max_tokens=num_tokens)
            step._gemm_blocks[proj] = (n, k, best)
            no_overlap = timed("shrink, then fused GEMM (no overlap)",
                               layers(lambda i, w, st=step: st.linear(i, proj, x, w)), best)
        finally:
            lora_gemm.OVERLAP_SHRINK = True
    # error of one layer against fp32 (the pool's weights upcast), fused (best) and usual
    errors = {}
    if best is not None:
        ref = _fp32_linear(pool, slots, active, proj, x, weights[0])
        step = LoRAStep(pool, slots, active, True, fused_gemm_max_tokens=num_tokens)
        step._gemm_blocks[proj] = (n, k, best)
        for name, st in (("fused", step), ("usual", usual_step)):
            err = (st.linear(0, proj, x, weights[0]).float() - ref).abs()
            errors[name] = {"max_abs": err.max().item(), "mean_abs": err.mean().item()}
    return {"proj": proj, "N": n, "K": k, "tokens": num_tokens, "rows": rows, "best_fused": list(best) if best else None,
            "default_blocks": list(default_blocks), "cublas_us": cublas and cublas * 1e6,
            "usual_us": usual and usual * 1e6, "fused_us": fused[0][0] * 1e6 if fused else None,
            "fused_no_overlap_us": no_overlap and no_overlap * 1e6,
            "triton_base_us": triton_times[0][0] * 1e6 if triton_times else None, "errors": errors,
            "floor_base_us": base_bytes / copy_bw * 1e6, "floor_lora_us": lora_bytes / copy_bw * 1e6}


def _fp32_linear(pool, slots, active, proj, x, weight) -> torch.Tensor:
    from loraplex.adapters.mapping import LoRAStep
    from loraplex.adapters.slot_pool import SlotPool

    up = SlotPool(pool.shapes, pool.max_loras, pool.max_rank, pool.device, torch.float32)
    for name in ("a", "bt"):
        getattr(up, name)[proj].copy_(getattr(pool, name)[proj].float())
    up.ranks.copy_(pool.ranks)
    up.scaling.copy_(pool.scaling)
    out = LoRAStep(up, slots, active, True).linear(0, proj, x.float(), weight.float())
    del up
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loraplex.bench.lora_gemm", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="docs/benchmarks/lora_gemm_h200.json", help="JSON path (.md beside it)")
    parser.add_argument("--tokens", default="64,256",
                        help="step sizes (comma-separated; tokens on up to 64 distinct adapters, round robin): the "
                             "first gets the full sweep and the in-layer run, the others the first's 4 fastest "
                             "configurations at row tiles of 64 and 128")
    parser.add_argument("--reps", type=int, default=30, help="graph replays per figure")
    parser.add_argument("--no-in-layer", action="store_true", help="skip the whole-step in-layer comparison")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU with TRITON_INTERPRET=1)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from loraplex.adapters.modules import PROJ_MODULES, BaseShapes
    from loraplex.adapters.slot_pool import SlotPool
    from loraplex.bench import lora_kernels
    from loraplex.bench.roofline import measure_copy_bandwidth
    from loraplex.kernels import lora_gemm

    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if device.type != "cuda" and not args.smoke:
        parser.error("needs CUDA; use --smoke on the CPU (with TRITON_INTERPRET=1)")
    if device.type != "cuda":
        _use_interpreter()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.smoke:
        shapes = BaseShapes(num_layers=2, hidden_size=64, q_size=64, kv_size=32, intermediate_size=96)
        sweep, rank, token_counts = SMOKE_SWEEP, 8, [8, 12]
    else:
        shapes = BaseShapes(num_layers=32, hidden_size=4096, q_size=4096, kv_size=1024, intermediate_size=14336)
        sweep, rank, token_counts = SWEEP, 16, [int(t) for t in args.tokens.split(",") if t]
    tokens = token_counts[0]
    copy_bw = measure_copy_bandwidth(device) if device.type == "cuda" else 1e11
    num_slots = min(tokens, 64)
    pool = SlotPool(shapes, num_slots, rank, device, dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    for t in (*pool.a.values(), *pool.bt.values()):
        t.normal_(0.0, 0.02, generator=gen)
    pool.ranks.fill_(rank)
    pool.scaling.fill_(2.0)
    payload = {"command": module_command("loraplex.bench.lora_gemm", argv), "environment": environment(device),
               "copy_bandwidth_gb_s": copy_bw / 1e9, "tokens": tokens, "rank": rank, "adapters": num_slots,
               "layers": shapes.num_layers, "projections": []}
    started = time.perf_counter()
    tuned: dict = {}
    for i, count in enumerate(token_counts):
        slots = (torch.arange(count, dtype=torch.int32) % num_slots).to(device)
        for proj in PROJ_MODULES:
            if i == 0:
                result = bench_projection(shapes, proj, pool, slots, count, device, dtype, copy_bw, args.reps, sweep)
            else:  # the first size's fastest configurations at two row tiles
                first = next(p for p in payload["projections"] if p["proj"] == proj and p["tokens"] == tokens)
                best = sorted((r for r in first["rows"] if r["variant"] == "Triton GEMM"),
                              key=lambda r: r["us_per_layer"])[:4]
                few = tuple({tuple(r["config"][2:]) for r in best})
                bns = {r["config"][1] for r in best}
                result = bench_projection(shapes, proj, pool, slots, count, device, dtype, copy_bw, args.reps,
                                          few, bms=(64, 128))
                result["rows"] = [r for r in result["rows"] if r["config"] is None or r["config"][1] in bns]
            payload["projections"].append(result)
            write_json_and_markdown(args.out, payload, _markdown(payload))  # a run cut short keeps what it measured
            if result["best_fused"]:
                from loraplex.kernels.lora_gemm import rows_bucket

                tuned[(result["N"], result["K"], rows_bucket(count))] = tuple(result["best_fused"])
            _sync(device)
    del pool
    payload["tuned_blocks"] = {f"{n}x{k}/{b}": list(v) for (n, k, b), v in tuned.items()}
    if not args.no_in_layer:
        lora_gemm.TUNED_BLOCKS.update(tuned)
        policies = [(name, opts) for name, opts in lora_kernels.IN_LAYER_POLICIES
                    if name in ("sequential", "expand-first", "fused GEMM")]
        mixes = STEP_MIXES if not args.smoke else (("distinct", tokens), ("identical", 1))
        payload["in_layer"] = lora_kernels.bench_in_layer(shapes, tokens, rank, device, dtype, copy_bw, args.reps,
                                                          mixes=mixes, policies=policies)
    payload["seconds"] = time.perf_counter() - started
    write_json_and_markdown(args.out, payload, _markdown(payload))
    return 0


def _markdown(payload: dict) -> str:
    from loraplex.bench.lora_kernels import _in_layer_markdown

    lines = [*markdown_head(f"LoRA expand inside the base GEMM ({payload['environment'].get('gpu', 'cpu')})",
                            payload["command"]),
             f"Copy bandwidth {payload['copy_bandwidth_gb_s']:.0f} GB/s. Tokens on up to {payload['adapters']} "
             f"distinct rank-{payload['rank']} adapters (round robin), {payload['layers']} layers in one CUDA graph "
             "per figure (distinct weights per layer), time per layer.", "",
             "| tokens | proj | cuBLAS (us) | cuBLAS + shrink + expand | Triton GEMM (best) | shrink + fused GEMM (best) | "
             "same, no overlap | LoRA adds, usual | LoRA adds, fused | base floor | LoRA floor | best fused config | "
             "max abs err vs fp32, fused / usual |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in payload["projections"]:
        def f(v):
            return "—" if v is None else f"{v:.2f}"
        adds_u = None if p["usual_us"] is None or p["cublas_us"] is None else p["usual_us"] - p["cublas_us"]
        adds_f = None if p["fused_us"] is None or p["cublas_us"] is None else p["fused_us"] - p["cublas_us"]
        err = p["errors"]
        err_s = f"{err['fused']['max_abs']:.2e} / {err['usual']['max_abs']:.2e}" if err else "—"
        lines.append(f"| {p['tokens']} | {p['proj']} | {f(p['cublas_us'])} | {f(p['usual_us'])} | {f(p['triton_base_us'])} | "
                     f"{f(p['fused_us'])} | {f(p.get('fused_no_overlap_us'))} | {f(adds_u)} | {f(adds_f)} | {f(p['floor_base_us'])} | "
                     f"{f(p['floor_lora_us'])} | {p['best_fused']} | {err_s} |")
    lines += ["", "Every configuration (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages):", "",
              "| tokens | proj | variant | config | us / layer | % copy BW |", "|---|---|---|---|---|---|"]
    for p in payload["projections"]:
        for r in sorted(p["rows"], key=lambda r: (r["variant"], r["us_per_layer"])):
            lines.append(f"| {p['tokens']} | {r['proj']} | {r['variant']} | {r['config'] or '—'} | {r['us_per_layer']:.2f} | "
                         f"{r['pct_copy_bw']:.1f} |")
    lines += [""] + _in_layer_markdown(payload.get("in_layer"))
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
