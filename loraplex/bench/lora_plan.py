"""The LoRA work of one large decode step under the decode graph's plan and under plans for fewer adapters.

The engine's decode CUDA graph of a bucket plans its LoRA launches for ``min(bucket, max_loras)`` distinct adapters
(every row its own adapter): the chunk tables, and so every grid, hold ``cdiv(bucket, 16) + min(bucket, max_loras)``
chunks, and a step of 31 adapters (the offline bench's uniform workload) or ~46 (zipf 1.5 over 1,000) replays grids
sized for 256. A plan for at most N adapters (``LoRAStep(max_adapters=N)``) sizes them for N. This measured what that
is worth before a decode-graph variant per plan was kept: on an H100 every plan of 64 or fewer was 0.03-0.22 ms slower
than the graph's own (its extra programs give the chunks in use more K parts in the shrink), so the engine has no
such variant (docs/benchmarks/NOTES-lora.md):

    python -m loraplex.bench.lora_plan --tokens 256 --plans 128,64,32 --out docs/benchmarks/lora_plan_h200.json

Per mix (distinct, uniform 32, zipf 1.5 of 1,000, 8 adapters, 1) and plan (``graph``: the engine's; ``<= N``: at most
N), the median CUDA-graph replay of all 32 layers' LoRA work (shrink + expand of q|k|v, o, gate|up, down), metadata built
inside the graph from the static slot buffer as the engine does. A plan runs only the mixes it covers. ``--variants``:
the graph plan with more programs per launch (expand splits, shrink K parts ×2 or ×4). ``--smoke``:
tiny shapes on the CPU under the interpreter (checks the harness, times nothing of note).
"""

from __future__ import annotations

import argparse
import logging
import sys

import torch

from loraplex.bench.report import kernel_environment, markdown_head, module_command, write_json_and_markdown

log = logging.getLogger(__name__)

ZIPF_EXPONENT = 1.5
ZIPF_POPULATION = 1000

# launch-size variants of the graph plan (``--variants``): each projection's configuration changed by a function of it
VARIANTS = {
    "en-x2": lambda c: {"expand_splits": c.expand_splits and 2 * c.expand_splits},  # None: one program per tile
    "en-x4": lambda c: {"expand_splits": c.expand_splits and 4 * c.expand_splits},
    "sk-x2": lambda c: {"split_k": 2 * c.split_k},
    "sk-x2-en-x2": lambda c: {"split_k": 2 * c.split_k, "expand_splits": c.expand_splits and 2 * c.expand_splits},
}


def _with_variant(step, name: str | None):
    """``step`` with the launch sizes of variant ``name`` (None: as planned); the fp32 scratch grown if needed."""
    if name is not None:
        step.replace_configs(lambda proj, cfg: VARIANTS[name](cfg))
    return step


def zipf_slots(num_tokens: int, seed: int = 0, exponent: float = ZIPF_EXPONENT,
               population: int = ZIPF_POPULATION) -> torch.Tensor:
    """Slots of ``num_tokens`` rows whose adapters are drawn from a zipf law over ``population`` adapters (seeded),
    each distinct adapter numbered 0, 1, ... in order of first appearance (its GPU slot)."""
    gen = torch.Generator().manual_seed(seed)
    weights = torch.arange(1, population + 1, dtype=torch.float64).pow(-exponent)
    draws = torch.multinomial(weights, num_tokens, replacement=True, generator=gen)
    _, slots = torch.unique(draws, sorted=False, return_inverse=True)
    # renumber by first appearance (unique's order is not specified)
    order: dict[int, int] = {}
    return torch.tensor([order.setdefault(int(s), len(order)) for s in slots], dtype=torch.int32)


def mixes_for(num_tokens: int, real: int) -> list[tuple[str, torch.Tensor]]:
    """(name, slots [num_tokens]) of the measured mixes: the first ``real`` rows carry adapters, the rest are
    padding (slot -1), as a bucket replayed for fewer sequences."""
    from loraplex.bench.lora_kernels import _mix_slots

    uniform = max(1, round(ZIPF_POPULATION ** 0.5))
    out = []
    for name, slots in (("distinct", _mix_slots(real, real, "cpu")),
                        (f"uniform {uniform}", _mix_slots(real, min(uniform, real), "cpu")),
                        ("zipf 1.5", zipf_slots(real)),
                        ("8 adapters", _mix_slots(real, min(8, real), "cpu")),
                        ("1 adapter", _mix_slots(real, 1, "cpu"))):
        full = torch.full((num_tokens,), -1, dtype=torch.int32)
        full[:real] = slots
        out.append((name, full))
    return out


def run(shapes, num_tokens: int, real: int, plans: list[int], rank: int, device, dtype, copy_bw: float,
        reps: int, profile: bool = True, variants: tuple[str, ...] = ()) -> dict:
    from loraplex.adapters.mapping import LoRAStep
    from loraplex.bench.lora_kernels import (
        _capture,
        _DecodeStepBench,
        _kernel_table,
        _profile_kernels,
        _replay_seconds,
        _sync,
    )

    bench = _DecodeStepBench(shapes, num_tokens, rank, device, dtype)
    graph_plan = min(num_tokens, bench.pool.max_loras)
    mixes = mixes_for(num_tokens, real)
    rows, kernel_rows = [], []
    cases = [(None, None), *((None, v) for v in variants),
             *((p, None) for p in sorted({p for p in plans if p < graph_plan}, reverse=True))]
    for plan, variant in cases:
        covered = [(m, s) for m, s in mixes if plan is None or len(torch.unique(s[s >= 0])) <= plan]
        if not covered:
            continue
        bound = plan or graph_plan
        bench.slots.copy_(covered[0][1].to(device))
        _sync(device)

        def make(bound=bound, plan=plan, variant=variant):
            return _with_variant(LoRAStep(bench.pool, bench.slots, bound, use_triton=True, max_adapters=plan), variant)

        graph = _capture(lambda make=make: bench.run(make()), device)
        chunks = make()._meta.max_chunks
        label = ("graph" if plan is None else f"<= {plan}") + (f", {variant}" if variant else "")
        for mix, slots in covered:
            bench.slots.copy_(slots.to(device))
            _sync(device)
            seconds = _replay_seconds(graph, reps)
            adapters = len(torch.unique(slots[slots >= 0]))
            weights, acts = bench.bytes_needed(adapters)
            row = {"plan": label, "max_adapters": bound, "max_chunks": chunks,
                   "mix": mix, "adapters": adapters, "tokens": num_tokens, "real_tokens": real, "rank": rank,
                   "time_ms": seconds * 1e3, "floor_ms": (weights + acts) / copy_bw * 1e3}
            if profile and device.type == "cuda":
                summary, per_kernel = _kernel_table(_profile_kernels(graph), bench, adapters, copy_bw)
                row.update({k: v for k, v in summary.items() if k != "kernel_names"})
                kernel_rows += [{"plan": row["plan"], "mix": mix, **r} for r in per_kernel]
            rows.append(row)
            log.info("PLAN %s", row)
        del graph
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"tokens": num_tokens, "real_tokens": real, "slots": bench.pool.max_loras, "rank": rank, "rows": rows,
            "kernels": kernel_rows}


def _gate_up_weights(shapes, device, dtype) -> list[torch.Tensor]:
    """Random base gate|up weights of every layer (seeded), for the SiLU benches."""
    gen = torch.Generator(device=device).manual_seed(2)
    width = sum(shapes.slice_widths("gate_up"))
    return [torch.empty(width, shapes.proj_in("gate_up"), dtype=dtype, device=device).normal_(0.0, 0.02, generator=gen)
            for _ in range(shapes.num_layers)]


def _silu_mul(device):
    """SiLU-and-multiply as the engine runs it: the Triton kernel on CUDA, its twin elsewhere."""
    if device.type == "cuda":
        from loraplex.kernels.fused_ops import silu_mul

        return silu_mul
    from loraplex.kernels.fused_ops_ref import silu_mul_ref

    return silu_mul_ref


def silu_ab(shapes, num_tokens: int, real: int, rank: int, device, dtype, reps: int) -> list[dict]:
    """gate|up with SiLU-and-multiply, 32 layers, one CUDA graph each: the base GEMM, then either the LoRA expand into
    gate|up and ``silu_mul`` (the default) or the delta inside SiLU-and-multiply (``LoRAStep.silu_mul``, engine option
    fuse_lora_silu_mul), per mix; plus the base GEMM and ``silu_mul`` alone. Median replay, ms."""
    from loraplex.adapters.mapping import LoRAStep
    from loraplex.bench.lora_kernels import _capture, _DecodeStepBench, _replay_seconds, _sync

    silu_mul = _silu_mul(device)
    bench = _DecodeStepBench(shapes, num_tokens, rank, device, dtype)
    weights = _gate_up_weights(shapes, device, dtype)
    x = bench.xs["gate_up"]
    rows = []

    def run(fused: bool | None) -> None:
        step = None if fused is None else LoRAStep(bench.pool, bench.slots, bench.num_active, use_triton=True,
                                                    fuse_silu_mul=fused)
        for layer in range(shapes.num_layers):
            gate_up = torch.nn.functional.linear(x, weights[layer])
            if step is not None and fused:
                step.silu_mul(layer, x, gate_up)
            else:
                if step is not None:
                    step.add(layer, "gate_up", x, gate_up)
                silu_mul(gate_up)

    for name, fused in (("base GEMM + silu_mul", None), ("expand, then silu_mul", False),
                        ("delta inside silu_mul", True)):
        graph = None
        for mix, slots in mixes_for(num_tokens, real) if fused is not None else [("—", None)]:
            if slots is not None:
                bench.slots.copy_(slots.to(device))
                _sync(device)
            if graph is None:
                graph = _capture(lambda fused=fused: run(fused), device)
            rows.append({"path": name, "mix": mix, "time_ms": _replay_seconds(graph, reps) * 1e3})
            log.info("SILU %s", rows[-1])
        del graph
    return rows


def prompt_mixes(num_tokens: int, prompt_len: int) -> list[tuple[str, torch.Tensor]]:
    """(name, slots [num_tokens]) of a prompt step: rows in requests of ``prompt_len`` tokens (the last one shorter),
    every request one adapter, drawn per mix (distinct: each request its own; uniform over 32; zipf 1.5 of 1,000;
    8 adapters; one)."""
    requests = -(-num_tokens // prompt_len)
    gen = torch.Generator().manual_seed(3)
    uniform = max(1, round(ZIPF_POPULATION ** 0.5))
    per_request = (("distinct", torch.arange(requests)),
                   (f"uniform {uniform}", torch.randint(0, uniform, (requests,), generator=gen)),
                   ("zipf 1.5", zipf_slots(requests)),
                   ("8 adapters", torch.randint(0, 8, (requests,), generator=gen)),
                   ("1 adapter", torch.zeros(requests, dtype=torch.int64)))
    out = []
    for name, adapters in per_request:
        _, dense = torch.unique(adapters, return_inverse=True)  # slots 0..n-1
        out.append((name, dense.to(torch.int32).repeat_interleave(prompt_len)[:num_tokens]))
    return out


def silu_prompt_ab(shapes, num_tokens: int, prompt_len: int, rank: int, device, dtype, reps: int) -> list[dict]:
    """gate|up with SiLU-and-multiply in a prompt step (rows in requests of ``prompt_len`` tokens, one adapter each),
    32 layers, one CUDA graph per path and mix, the step built outside it with the mix's real adapter count as the
    engine builds a prompt step: the base GEMM + ``silu_mul`` alone; the engine's default order at this size
    (``lora_expand_first_min_tokens``: the shrink, a write-only expand, the GEMM accumulating into it, then
    ``silu_mul``); the delta inside SiLU-and-multiply (fuse_lora_silu_mul: the GEMM, the shrink, ``lora_silu_mul``).
    Median replay, ms."""
    from loraplex.adapters.mapping import LoRAStep
    from loraplex.bench.lora_kernels import _capture, _DecodeStepBench, _replay_seconds, _sync
    from loraplex.engine.config import EngineConfig

    silu_mul = _silu_mul(device)
    mixes = prompt_mixes(num_tokens, prompt_len)
    slots_needed = max(int(s.max()) + 1 for _, s in mixes)
    bench = _DecodeStepBench(shapes, num_tokens, rank, device, dtype, num_slots=slots_needed)
    weights = _gate_up_weights(shapes, device, dtype)
    x = bench.xs["gate_up"]
    expand_first = EngineConfig.__dataclass_fields__["lora_expand_first_min_tokens"].default
    rows = []

    def run(step, fused: bool) -> None:
        for layer in range(shapes.num_layers):
            if step is None:
                silu_mul(torch.nn.functional.linear(x, weights[layer]))
            elif fused:
                step.silu_mul(layer, x, torch.nn.functional.linear(x, weights[layer]))
            else:
                silu_mul(step.linear(layer, "gate_up", x, weights[layer]))

    graph = _capture(lambda: run(None, False), device)
    rows.append({"path": "base GEMM + silu_mul", "mix": "—", "adapters": 0, "tokens": num_tokens,
                 "time_ms": _replay_seconds(graph, reps) * 1e3})
    del graph
    for mix, slots in mixes:
        bench.slots.copy_(slots.to(device))
        _sync(device)
        adapters = len(torch.unique(slots))
        for name, fused in (("default order, then silu_mul", False), ("delta inside silu_mul", True)):
            step = LoRAStep(bench.pool, bench.slots, adapters, use_triton=True, fuse_silu_mul=fused,
                            expand_first_min_tokens=expand_first, has_base_tokens=False)
            graph = _capture(lambda step=step, fused=fused: run(step, fused), device)
            rows.append({"path": name, "mix": mix, "adapters": adapters, "tokens": num_tokens,
                         "time_ms": _replay_seconds(graph, reps) * 1e3})
            log.info("SILU-PROMPT %s", rows[-1])
            del graph, step
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def markdown(payload: dict) -> str:
    res = payload["plan"]
    lines = markdown_head(f"LoRA work of a {res['tokens']}-row decode step ({res['real_tokens']} sequences) by plan",
                          payload["command"])
    lines += [f"Device: {payload['environment']['device_name']}, torch {payload['environment']['torch']}, triton "
              f"{payload['environment']['triton']}; copy bandwidth {payload['copy_bandwidth_gb_s']:.0f} GB/s; "
              f"{res['slots']} slots, rank {res['rank']}.", "",
              "Time: median CUDA-graph replay of the 32 layers' LoRA work (metadata built in the graph). `graph`: the "
              "engine's decode-graph plan (every row its own adapter); `<= N`: chunk tables and grids for at most N "
              "adapters.", "",
              "| mix | adapters | plan | chunks | time (ms) | floor (ms) | vs graph |", "|---|---|---|---|---|---|---|"]
    base = {r["mix"]: r["time_ms"] for r in res["rows"] if r["plan"] == "graph"}
    for r in res["rows"]:
        ref = base.get(r["mix"])
        delta = f"{r['time_ms'] - ref:+.3f} ms" if ref is not None and r["plan"] != "graph" else ""
        lines.append(f"| {r['mix']} | {r['adapters']} | {r['plan']} | {r['max_chunks']} | {r['time_ms']:.3f} | "
                     f"{r['floor_ms']:.3f} | {delta} |")
    if payload.get("silu"):
        lines += ["", "gate|up + SiLU-and-multiply, 32 layers (`--silu`; ms, median replay):", "",
                  "| path | mix | time (ms) |", "|---|---|---|"]
        lines += [f"| {r['path']} | {r['mix']} | {r['time_ms']:.3f} |" for r in payload["silu"]]
    if payload.get("silu_prompt"):
        rows = payload["silu_prompt"]
        lines += ["", f"gate|up + SiLU-and-multiply in a prompt step of {rows[0]['tokens']} tokens, requests of "
                  f"{payload['prompt_len']} (`--silu-prompt`; ms, median replay of 32 layers):", "",
                  "| path | mix | adapters | time (ms) |", "|---|---|---|---|"]
        lines += [f"| {r['path']} | {r['mix']} | {r['adapters']} | {r['time_ms']:.3f} |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from loraplex.bench.lora_kernels import LLAMA3_8B, SMOKE, _use_interpreter, measure_copy_bandwidth

    parser = argparse.ArgumentParser(prog="python -m loraplex.bench.lora_plan", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="docs/benchmarks/lora_plan_h200.json", help="JSON path (.md beside it)")
    parser.add_argument("--tokens", type=int, default=256, help="rows of the step (a decode-graph bucket)")
    parser.add_argument("--real", type=int, default=None, help="rows carrying adapters (default: tokens - 8)")
    parser.add_argument("--plans", default="128,64,32", help="comma-separated adapter bounds to plan for")
    parser.add_argument("--variants", default="", help=f"comma-separated launch-size variants of the graph plan "
                                                        f"({', '.join(VARIANTS)})")
    parser.add_argument("--silu", action="store_true",
                        help="also gate|up + SiLU-and-multiply with the delta inside it (fuse_lora_silu_mul) or not")
    parser.add_argument("--silu-prompt", type=int, default=0, metavar="TOKENS",
                        help="also gate|up + SiLU-and-multiply in a prompt step of TOKENS rows (requests of "
                             "--prompt-len), default order against the delta inside SiLU (0: not run)")
    parser.add_argument("--prompt-len", type=int, default=256, help="tokens per request of --silu-prompt")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--no-profile", action="store_true", help="skip the per-kernel profile")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (TRITON_INTERPRET=1)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from loraplex.adapters.modules import BaseShapes

    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if device.type != "cuda" and not args.smoke:
        parser.error("needs CUDA; use --smoke on the CPU")
    if device.type != "cuda":
        _use_interpreter()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = BaseShapes.from_config(SMOKE if args.smoke else LLAMA3_8B)
    real = args.real if args.real is not None else max(1, args.tokens - 8)
    if not 0 < real <= args.tokens:
        parser.error(f"--real must be in 1..{args.tokens}, got {real}")
    plans = [int(p) for p in args.plans.split(",") if p.strip()]
    variants = tuple(v.strip() for v in args.variants.split(",") if v.strip())
    if set(variants) - set(VARIANTS):
        parser.error(f"--variants: unknown {', '.join(sorted(set(variants) - set(VARIANTS)))}; known: "
                     f"{', '.join(VARIANTS)}")
    copy_bw = measure_copy_bandwidth(device, 1 << (22 if args.smoke else 30), iters=100)
    payload = {"command": module_command("loraplex.bench.lora_plan", argv),
               "environment": kernel_environment(device, dtype), "copy_bandwidth_gb_s": copy_bw / 1e9}
    payload["plan"] = run(shapes, args.tokens, real, plans, 16, device, dtype, copy_bw,
                          min(args.reps, 3) if args.smoke else args.reps, profile=not args.no_profile,
                          variants=variants)
    if args.silu:
        payload["silu"] = silu_ab(shapes, args.tokens, real, 16, device, dtype, min(args.reps, 3) if args.smoke
                                  else args.reps)
    if args.silu_prompt:
        payload["prompt_len"] = args.prompt_len
        payload["silu_prompt"] = silu_prompt_ab(shapes, args.silu_prompt, args.prompt_len, 16, device, dtype,
                                                min(args.reps, 3) if args.smoke else min(args.reps, 20))
    write_json_and_markdown(args.out, payload, markdown(payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
