"""Does folding the o / down LoRA expand into the residual add + RMSNorm pay in a decode step?

For each projection (o: K = 4096, down: K = 14336; N = 4096, rank 16) and each mix, one CUDA graph per variant over
32 layers (distinct weights per layer, so nothing is served from L2 across layers), median replay:

- ``norm``: the residual add + RMSNorm alone (what the step pays without LoRA);
- ``expand+norm``: the shrink, the expand into the projection output, then the residual add + RMSNorm (today);
- ``fused rS wW``: the shrink, then ``lora_add_rms_norm`` (R_STEP = S rank rows per load, W warps).

The LoRA cost of each variant is its time minus ``norm``'s. Usage (device):

    python3 docs/benchmarks/scripts/norm_fold.py --out $OUT/norm_fold.json
    TRITON_INTERPRET=1 python3 docs/benchmarks/scripts/norm_fold.py --smoke     # CPU: shapes tiny, checks only
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from loraplex.kernels import fused_ops, fused_ops_ref
from loraplex.kernels.lora_add_rms_norm import lora_add_rms_norm, lora_add_rms_norm_ref
from loraplex.kernels.lora_meta import build_lora_meta
from loraplex.kernels.lora_ops import choose_config, lora_expand_apply, lora_shrink_apply
from loraplex.kernels.lora_ref import lora_shrink_ref
from loraplex.kernels.lora_shrink import pdl_supported

# (name, tokens, slots, adapters)
MIXES = (("64 distinct", 64, 64, 64), ("64 on 8", 64, 64, 8), ("64 on 1", 64, 64, 1),
         ("248 zipf-like on 256 slots", 248, 256, 46), ("248 distinct", 248, 256, 248), ("16 distinct", 16, 16, 16))
SMOKE_MIXES = (("8 distinct", 8, 8, 8), ("8 on 2", 8, 8, 2))
VARIANTS = ((4, 8), (4, 16), (8, 16), (16, 16), (2, 8))


def _slots(tokens: int, adapters: int, zipf: bool, device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(tokens * 1000 + adapters)
    if zipf:
        weights = 1.0 / torch.arange(1, adapters + 1, dtype=torch.float64) ** 1.5
        slots = torch.multinomial(weights, tokens, replacement=True, generator=gen)
        slots[:adapters] = torch.arange(adapters)  # every adapter present at least once
    else:
        slots = torch.arange(tokens) % adapters
    return slots[torch.randperm(tokens, generator=gen)].to(torch.int32).to(device)


def _graph_ms(fn, device, reps: int) -> float:
    if device.type != "cuda":
        fn()
        return float("nan")
    from loraplex.kernels.lora_testing import capture_cuda_graph

    graph = capture_cuda_graph(fn)
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(reps):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end))
    return statistics.median(times)


def run_case(proj: str, k_dim: int, n_dim: int, layers: int, mix, rank: int, device, dtype, reps: int) -> dict:
    name, tokens, num_slots, adapters = mix
    slots = _slots(tokens, adapters, "zipf" in name, device)
    gen = torch.Generator(device=device).manual_seed(0)
    a = [torch.empty(num_slots, 1, rank, k_dim, dtype=dtype, device=device).normal_(0, 0.02, generator=gen)
         for _ in range(layers)]
    b = [torch.empty(num_slots, rank, n_dim, dtype=dtype, device=device).normal_(0, 0.02, generator=gen)
         for _ in range(layers)]
    ranks = torch.full((1, num_slots), rank, dtype=torch.int32, device=device)
    scaling = torch.full((num_slots,), 2.0, dtype=torch.float32, device=device)
    loc = torch.tensor([0, n_dim], dtype=torch.int32, device=device)
    x_in = torch.randn(tokens, k_dim, dtype=dtype, device=device)
    base = torch.randn(tokens, n_dim, dtype=dtype, device=device)
    work = base.clone()
    residual = torch.randn(tokens, n_dim, dtype=dtype, device=device)
    weight = 1.0 + 0.1 * torch.randn(n_dim, dtype=dtype, device=device)
    active = int(torch.unique(slots).numel())
    cfg = choose_config(tokens, active, num_slots, rank, k_dim, 1, n_dim, pdl=pdl_supported(device))
    meta = build_lora_meta(slots, num_slots, cfg.block_m)
    scratch = torch.empty(cfg.parts_max, 1, tokens, rank, dtype=torch.float32, device=device)
    eps = 1e-5

    def norm_only():
        for _ in range(layers):
            fused_ops.add_rms_norm(base, residual, weight, eps)

    def unfused():
        for layer in range(layers):
            y, valid = lora_shrink_apply(x_in, a[layer], ranks, meta, cfg, scratch, None)
            lora_expand_apply(y, valid, work, b[layer], ranks, scaling, loc, n_dim, meta, cfg, 16)
            fused_ops.add_rms_norm(work, residual, weight, eps)

    def fused(r_step, warps):
        def fn():
            for layer in range(layers):
                y, valid = lora_shrink_apply(x_in, a[layer], ranks, meta, cfg, scratch, None)
                lora_add_rms_norm(base, residual, weight, eps, y, b[layer], ranks, scaling, meta, **valid,
                                  r_step=r_step, num_warps=warps)
        return fn

    # correctness of one layer against the twin before timing
    y, valid = lora_shrink_apply(x_in, a[0], ranks, meta, cfg, scratch, None)
    got_out, got_res = lora_add_rms_norm(base, residual, weight, eps, y, b[0], ranks, scaling, meta, **valid)
    y_ref = lora_shrink_ref(x_in.float(), a[0].float(), slots, ranks)
    want_out, want_res = lora_add_rms_norm_ref(base.float(), residual.float(), weight.float(), eps, y_ref,
                                               b[0].float(), slots, ranks, scaling)
    err = max((got_out.float() - want_out).abs().max().item(), (got_res.float() - want_res).abs().max().item())
    plain_out, _ = fused_ops_ref.add_rms_norm_ref(base.float(), residual.float(), weight.float(), eps)
    delta = (want_out - plain_out).abs().max().item()

    row = {"proj": proj, "mix": name, "tokens": tokens, "slots": num_slots, "adapters": active,
           "max_abs_err_vs_fp32_twin": err, "max_abs_delta": delta}
    row["norm_ms"] = _graph_ms(norm_only, device, reps)
    work.copy_(base)
    row["expand+norm_ms"] = _graph_ms(unfused, device, reps)
    for r_step, warps in VARIANTS:
        row[f"fused r{r_step} w{warps}_ms"] = _graph_ms(fused(r_step, warps), device, reps)
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (interpreter), no timing")
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    if args.smoke:
        projs, layers, mixes = (("o", 32, 48), ("down", 64, 48)), 2, SMOKE_MIXES
    else:
        projs, layers, mixes = (("o", 4096, 4096), ("down", 14336, 4096)), 32, MIXES
    rows = []
    start = time.perf_counter()
    for proj, k_dim, n_dim in projs:
        for mix in mixes:
            row = run_case(proj, k_dim, n_dim, layers, mix, 16, device, dtype, args.reps)
            print(json.dumps(row), flush=True)
            rows.append(row)
    print(f"# {time.perf_counter() - start:.1f} s", file=sys.stderr)
    if not args.smoke:
        lines = ["| proj | mix | norm (us/layer) | expand+norm: LoRA us/layer | "
                 + " | ".join(f"fused r{r} w{w}" for r, w in VARIANTS) + " | err |",
                 "|---" * (5 + len(VARIANTS)) + "|"]
        for row in rows:
            base = row["norm_ms"]
            cells = [f"{(row[f'fused r{r} w{w}_ms'] - base) / layers * 1e3:.2f}" for r, w in VARIANTS]
            lines.append(f"| {row['proj']} | {row['mix']} | {base / layers * 1e3:.2f} | "
                         f"{(row['expand+norm_ms'] - base) / layers * 1e3:.2f} | " + " | ".join(cells)
                         + f" | {row['max_abs_err_vs_fp32_twin']:.3g} (delta {row['max_abs_delta']:.3g}) |")
        print("\n".join(lines))
        if args.out:
            with open(args.out, "w") as fh:
                json.dump({"rows": rows, "layers": layers, "table": lines}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
