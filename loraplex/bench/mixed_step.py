"""LoRA work of a mixed step (one prompt chunk per newly admitted request plus one decode token per running one), in
the layer, by kernel regime.

A step that admits requests while ~250 others decode holds thousands of prompt tokens in a few long segments and
hundreds of one-token segments. ``choose_config`` picks decode or prefill tiles from the mean tokens per adapter;
with distinct adapters that mean falls near 30 (decode tiles) although almost every token sits in a long segment.
This benchmark times the 32 layers' base projections with and without the LoRA work (one CUDA graph each, the step's
metadata built inside it, as ``lora_kernels --in-layer-tokens`` does) for each regime and adapter mix, and sums the
GPU time per kernel name from one profiled replay.

    python -m loraplex.bench.mixed_step --out docs/benchmarks/mixed-step-h200.json
    TRITON_INTERPRET=1 python -m loraplex.bench.mixed_step --smoke --out /tmp/mixed.json   # CPU, tiny shapes
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
from collections import defaultdict
from pathlib import Path

import torch

from loraplex.bench.lora_kernels import (
    LLAMA3_8B,
    SMOKE,
    _capture,
    _profile_kernels,
    _replay_seconds,
    _sync,
    cuda_or_smoke,
)
from loraplex.bench.report import kernel_environment, markdown_head, module_command
from loraplex.bench.roofline import measure_copy_bandwidth

log = logging.getLogger("loraplex.bench.mixed_step")

REGIMES = ("auto", "decode", "prefill")


def zipf_ids(num: int, num_adapters: int, alpha: float, seed: int) -> list[int]:
    """``num`` adapter ids in 1..num_adapters drawn with probability ~ rank^-alpha (seeded)."""
    gen = torch.Generator().manual_seed(seed)
    weights = torch.arange(1, num_adapters + 1, dtype=torch.float64).pow(-alpha)
    return (torch.multinomial(weights, num, replacement=True, generator=gen) + 1).tolist()


def mixed_slots(decode: int, prompts: int, prompt_len: int, request_adapters: list[int]) -> tuple[list[int], int]:
    """Per-token slots of a step: ``decode`` one-token requests, then ``prompts`` requests of ``prompt_len`` tokens;
    request i uses adapter ``request_adapters[i]`` (ids mapped to slots in order of first use). Returns (slots,
    distinct adapters)."""
    slot_of: dict[int, int] = {}
    slots: list[int] = []
    for i, adapter in enumerate(request_adapters[:decode + prompts]):
        slot = slot_of.setdefault(adapter, len(slot_of))
        slots.extend([slot] * (1 if i < decode else prompt_len))
    return slots, len(slot_of)


def build_mixes(num_slots: int, decode: int, prompts: int, prompt_len: int) -> list[dict]:
    requests = decode + prompts
    if requests > num_slots:
        raise ValueError(f"{requests} requests of distinct adapters do not fit {num_slots} slots")
    mixes = []
    for name, ids in (("distinct", list(range(requests))),
                      ("zipf 1.5 of 1000", zipf_ids(requests, 1000, 1.5, seed=0)),
                      ("one adapter", [0] * requests)):
        slots, adapters = mixed_slots(decode, prompts, prompt_len, ids)
        mixes.append({"mix": name, "decode_tokens": decode, "prompts": prompts, "prompt_len": prompt_len,
                      "slots": slots, "adapters": adapters})
    if not decode:
        return mixes[:1]  # a few prompts: about as many adapters under every popularity
    slots, adapters = mixed_slots(0, prompts, prompt_len, list(range(prompts)))
    mixes.append({"mix": "prompts only, distinct", "decode_tokens": 0, "prompts": prompts, "prompt_len": prompt_len,
                  "slots": slots, "adapters": adapters})
    return mixes


def _kernel_sums(kernels) -> dict[str, float]:
    sums: dict[str, float] = defaultdict(float)
    if isinstance(kernels, str):
        return {}
    for name, _start, dur in kernels:
        sums[name.split("(")[0][:60]] += dur
    return dict(sorted(sums.items(), key=lambda kv: -kv[1]))


def run(shapes, num_slots: int, rank: int, mixes: list[dict], device, dtype, reps: int, profile: bool,
        regimes=REGIMES) -> list[dict]:
    from loraplex.adapters.mapping import LoRAStep
    from loraplex.adapters.modules import PROJ_MODULES
    from loraplex.adapters.slot_pool import SlotPool
    from loraplex.kernels import lora_ops

    pool = SlotPool(shapes, num_slots, rank, device, dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    for t in (*pool.a.values(), *pool.bt.values()):
        t.normal_(0.0, 0.02, generator=gen)
    pool.ranks.fill_(rank)
    pool.scaling.fill_(2.0)
    projs = tuple(PROJ_MODULES)
    weights = [{p: torch.empty(sum(shapes.slice_widths(p)), shapes.proj_in(p), dtype=dtype, device=device)
                .normal_(0.0, 0.02, generator=gen) for p in projs} for _ in range(shapes.num_layers)]
    rows = []
    for mix in mixes:
        num_tokens = len(mix["slots"])
        slots = torch.tensor(mix["slots"], dtype=torch.int32, device=device)
        xs = {p: torch.randn(num_tokens, shapes.proj_in(p), dtype=dtype, device=device) for p in projs}

        def layers(step, xs=xs) -> None:
            for layer in range(shapes.num_layers):
                for p in projs:
                    if step is None:
                        torch.nn.functional.linear(xs[p], weights[layer][p])
                    else:
                        step.linear(layer, p, xs[p], weights[layer][p])

        graph = _capture(lambda: layers(None), device)
        base_s = _replay_seconds(graph, reps)
        del graph
        original = lora_ops.choose_config
        for regime in regimes:
            lora_ops.choose_config = functools.partial(original, regime=None if regime == "auto" else regime)
            try:
                def with_lora(layers=layers, slots=slots, adapters=mix["adapters"]) -> None:
                    layers(LoRAStep(pool, slots, adapters, True, expand_first_min_tokens=128, has_base_tokens=False))

                probe = LoRAStep(pool, slots, mix["adapters"], True)
                chosen = "decode" if probe._configs["qkv"].block_m == 16 else "prefill"
                graph = _capture(with_lora, device)
                seconds = _replay_seconds(graph, reps)
                kernels = _kernel_sums(_profile_kernels(graph)) if profile and device.type == "cuda" else {}
                del graph
            finally:
                lora_ops.choose_config = original
            row = {k: v for k, v in mix.items() if k != "slots"}
            row.update(tokens=num_tokens, regime=regime, tiles=chosen, base_ms=base_s * 1e3,
                       time_ms=seconds * 1e3, added_ms=(seconds - base_s) * 1e3, kernels_us=kernels)
            log.info("MIXED %s", {k: v for k, v in row.items() if k != "kernels_us"})
            rows.append(row)
        _sync(device)
    return rows


def markdown(payload: dict) -> str:
    lines = markdown_head("LoRA work of a mixed step, by kernel regime", payload["command"])
    lines += ["", f"Pool: {payload['slots']} slots, rank {payload['rank']}, all seven projections, "
              f"{payload['layers']} layers. Time: median CUDA-graph replay of every layer's base projections with the "
              "LoRA work (write-first order, the engine's default from 128 tokens); added = that minus the base "
              "projections alone.", "",
              "| mix | tokens | decode tokens | prompts × length | adapters | regime | tiles | base (ms) | with LoRA (ms) "
              "| LoRA added (ms) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in payload["rows"]:
        lines.append(f"| {r['mix']} | {r['tokens']} | {r['decode_tokens']} | {r['prompts']} × {r['prompt_len']} | "
                     f"{r['adapters']} | {r['regime']} | {r['tiles']} | {r['base_ms']:.2f} | {r['time_ms']:.2f} | "
                     f"**{r['added_ms']:.2f}** |")
    profiled = [r for r in payload["rows"] if r["kernels_us"]]
    if profiled:
        lines += ["", "GPU time per kernel name, one profiled replay (µs, the five largest):", "",
                  "| mix | regime | kernels |", "|---|---|---|"]
        for r in profiled:
            top = "; ".join(f"{name} {us:,.0f}" for name, us in list(r["kernels_us"].items())[:5])
            lines.append(f"| {r['mix']} | {r['regime']} | {top} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loraplex.bench.mixed_step", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="docs/benchmarks/mixed-step-h200.json", help="JSON path (.md beside it)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU with TRITON_INTERPRET=1)")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--slots", type=int, default=256)
    parser.add_argument("--layouts", default="227:29:252,200:1:1848,0:1:2048",
                        help="comma-separated step layouts decode:prompts:prompt_len (one-token requests, prompt "
                             "chunks, tokens per chunk); default: an offline step at 8,192 tokens with 256 slots, "
                             "and two steps at the server's 2,048")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--regimes", default=",".join(REGIMES),
                        help=f"comma-separated, of {', '.join(REGIMES)} (auto: choose_config's own choice)")
    parser.add_argument("--no-profile", action="store_true")
    args = parser.parse_args(argv)
    regimes = [r.strip() for r in args.regimes.split(",") if r.strip()]
    if not regimes or set(regimes) - set(REGIMES):
        parser.error(f"--regimes: want some of {', '.join(REGIMES)}, got {args.regimes!r}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from loraplex.adapters.modules import BaseShapes

    device = cuda_or_smoke(parser, args.smoke)
    if args.smoke:
        shapes, dtype = BaseShapes.from_config(SMOKE), torch.float32
        slots, layouts, reps = 8, [(3, 1, 20)], 1
    else:
        shapes, dtype = BaseShapes.from_config(LLAMA3_8B), torch.bfloat16
        slots, reps = args.slots, args.reps
        try:
            layouts = [tuple(int(v) for v in item.split(":")) for item in args.layouts.split(",") if item.strip()]
        except ValueError:
            parser.error(f"--layouts: want decode:prompts:prompt_len items, got {args.layouts!r}")
        if not layouts or any(len(t) != 3 or min(t) < 0 or t[1] < 1 for t in layouts):
            parser.error(f"--layouts: want decode:prompts:prompt_len items with at least one prompt, got {args.layouts!r}")
    copy_bw = measure_copy_bandwidth(device, 1 << (22 if args.smoke else 30), iters=20 if args.smoke else 100)
    mixes = [m for layout in layouts for m in build_mixes(slots, *layout)]
    rows = run(shapes, slots, args.rank, mixes, device, dtype, reps, profile=not args.no_profile, regimes=regimes)
    payload = {"command": module_command("loraplex.bench.mixed_step", argv),
               "environment": kernel_environment(device, dtype),
               "copy_bandwidth_gb_s": copy_bw / 1e9, "slots": slots, "rank": args.rank, "layers": shapes.num_layers,
               "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(payload))
    log.info("wrote %s", out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
