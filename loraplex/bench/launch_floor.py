"""What the LoRA launches of a decode step cost before they move any bytes: the launch floor.

The 64-adapter decode step's LoRA work (256 launches: 32 layers x shrink + expand of q|k|v, o, gate|up, down) sits
~1 ms above its bandwidth floor, about 4 us per launch, and every kernel, even one moving under 1 MB, takes 3-5 us
(NOTES-lora.md). This benchmark measures how much of that any design with these launches pays anyway. It records
the grids, warps and PDL flags of the default decode step's launches (``LoRAStep`` at 64 tokens on 64 slots, the
engine's decode-graph plan) without running the LoRA kernels, then times one CUDA graph of the same launches with
stand-in bodies:

- ``empty``: the program returns at once (with PDL: it lets the next launch start, and its first program waits for
  the previous one, as ours do);
- ``chain``: the dependent loads every one of our programs makes before its first multiply: the chunk count, then
  the chunk's slot from a table, then a weight row at that slot (a fresh one per launch and program, so from HBM)
  and, after the PDL wait, a 16 x 128 activation tile; one store of 16 floats.

each with the recorded PDL flags and with PDL off, next to the real step's launches timed in the same call (metadata
built outside the graph: the ``LoRA launches only`` column of ``lora_kernels``).

Triton and every kernel module (the stand-ins: ``loraplex.kernels.stand_in``) are imported only once a run starts:
a kernel module imported before ``--smoke`` turns the interpreter on breaks the interpreted kernels (triton 3.9).

    python -m loraplex.bench.launch_floor --out docs/benchmarks/launch-floor.json
    TRITON_INTERPRET=1 python -m loraplex.bench.launch_floor --smoke --out /tmp/floor.json   # CPU, tiny shapes
"""

from __future__ import annotations

import argparse
import logging

import torch

from loraplex.bench.report import kernel_environment, module_command, write_json_and_markdown

log = logging.getLogger("loraplex.bench.launch_floor")

CHAIN_M, CHAIN_K = 16, 128  # the decode shrink's token tile and K tile (the stand-ins: kernels/stand_in.py)


def chain_reference(table: torch.Tensor, w: torch.Tensor, x: torch.Tensor, w_base: int, programs: int) -> torch.Tensor:
    """What the chain stand-in stores for ``programs`` programs (all below the count): [programs, CHAIN_M] float32."""
    rows = w[(w_base + table[:programs].long())].float()  # [programs, K]
    return rows @ x.float().t()


def record_launches(bench, step) -> list[dict]:
    """The LoRA kernel launches of ``bench.run(step)``, in order: kind, grid (3-D), num_warps, pdl. The kernels are
    replaced by recorders for the call, so none runs (their metadata kernels do)."""
    from loraplex.kernels import lora_expand, lora_shrink

    launches: list[dict] = []

    class _Recorder:
        def __init__(self, kind):
            self.kind = kind

        def __getitem__(self, grid):
            def launch(*args, num_warps=4, launch_pdl=False, **kwargs):
                g = tuple(grid) + (1,) * (3 - len(grid))
                launches.append({"kind": self.kind, "grid": g, "num_warps": num_warps, "pdl": bool(launch_pdl)})
            return launch

    saved = lora_shrink._lora_shrink_kernel, lora_expand._lora_expand_kernel
    lora_shrink._lora_shrink_kernel, lora_expand._lora_expand_kernel = _Recorder("shrink"), _Recorder("expand")
    try:
        bench.run(step)
    finally:
        lora_shrink._lora_shrink_kernel, lora_expand._lora_expand_kernel = saved
    return launches


def capped(grid: tuple[int, int, int], cap: int | None) -> tuple[int, int, int]:
    """``grid`` with its first dimension cut so that it holds at most ``cap`` programs (at least one per row of the
    other two dimensions)."""
    if cap is None:
        return grid
    rest = grid[1] * grid[2]
    return (max(1, min(grid[0], cap // rest)), grid[1], grid[2])


class _Stand:
    """Buffers of the stand-in launches: every (launch, program) reads its own weight row."""

    def __init__(self, launches: list[dict], device, dtype):
        self.launches = launches
        self.programs = [g[0] * g[1] * g[2] for g in (entry["grid"] for entry in launches)]
        widest = max(self.programs)
        self.count = torch.tensor([widest], dtype=torch.int32, device=device)
        gen = torch.Generator().manual_seed(0)
        self.table = torch.randperm(widest, generator=gen).to(torch.int32).to(device)
        self.w = torch.randn(len(launches) * widest, CHAIN_K, generator=gen).to(dtype).to(device)
        self.x = torch.randn(CHAIN_M, CHAIN_K, generator=gen).to(dtype).to(device)
        self.out = torch.zeros(widest, CHAIN_M, dtype=torch.float32, device=device)
        self.widest = widest

    def run(self, body: str, pdl: str, cap: int | None = None) -> None:
        """Every recorded launch with a stand-in body; ``cap``: at most that many programs per launch (the first grid
        dimension cut), to see what the launch costs with fewer programs."""
        from loraplex.kernels.stand_in import chain_kernel, empty_kernel

        for i, entry in enumerate(self.launches):
            use_pdl = entry["pdl"] if pdl == "as recorded" else False
            opts = {"num_warps": entry["num_warps"], **({"launch_pdl": True} if use_pdl else {})}
            grid = capped(entry["grid"], cap)
            if body == "empty":
                empty_kernel[grid](self.out, USE_PDL=use_pdl, **opts)
            else:
                chain_kernel[grid](self.count, self.table, self.w, self.x, self.out, i * self.widest,
                                             BLOCK_M=CHAIN_M, BLOCK_K=CHAIN_K, USE_PDL=use_pdl, **opts)


def run(shapes, num_tokens: int, rank: int, device, dtype, reps: int, grid_caps=()) -> dict:
    from loraplex.adapters.mapping import LoRAStep
    from loraplex.bench.lora_kernels import _capture, _DecodeStepBench, _mix_slots, _replay_seconds, _sync

    bench = _DecodeStepBench(shapes, num_tokens, rank, device, dtype)
    bench.slots.copy_(_mix_slots(num_tokens, min(num_tokens, bench.pool.max_loras), device))
    _sync(device)
    launches = record_launches(bench, bench.make_step(LoRAStep))
    stand = _Stand(launches, device, dtype)
    rows = []
    for mix, adapters in (("distinct", min(num_tokens, bench.pool.max_loras)), ("identical", 1)):
        bench.slots.copy_(_mix_slots(num_tokens, adapters, device))
        _sync(device)
        step = bench.make_step(LoRAStep)  # metadata of this mix outside the graph: only the LoRA launches inside
        graph = _capture(lambda step=step: bench.run(step), device)
        seconds = _replay_seconds(graph, reps)
        del graph
        rows.append({"launches": f"the real kernels, {mix}", "body": "real", "pdl": "as recorded",
                     "time_ms": seconds * 1e3, "us_per_launch": seconds * 1e6 / len(launches)})
    pdl_options = ("as recorded", "off") if any(e["pdl"] for e in launches) else ("off",)
    for cap in (None, *grid_caps):  # the recorded grids, then each cap
        for body in ("empty", "chain"):
            for pdl in pdl_options:
                graph = _capture(lambda body=body, pdl=pdl, cap=cap: stand.run(body, pdl, cap), device)
                seconds = _replay_seconds(graph, reps)
                del graph
                row = {"launches": f"stand-in: {body}", "body": body, "pdl": pdl, "time_ms": seconds * 1e3,
                       "us_per_launch": seconds * 1e6 / len(launches)}
                if cap is not None:
                    row.update(launches=f"stand-in: {body}, at most {cap} programs a launch", grid_cap=cap)
                rows.append(row)
    for r in rows:
        log.info("FLOOR %s", r)
    grids: dict[tuple, int] = {}
    for entry in launches:
        key = (entry["kind"], entry["grid"], entry["num_warps"], entry["pdl"])
        grids[key] = grids.get(key, 0) + 1
    return {"tokens": num_tokens, "rank": rank, "layers": shapes.num_layers, "num_launches": len(launches),
            "programs_total": sum(stand.programs), "rows": rows,
            "grids": [{"kind": k[0], "grid": list(k[1]), "num_warps": k[2], "pdl": k[3], "launches": n}
                      for k, n in grids.items()]}


def markdown(payload: dict) -> str:
    from loraplex.bench.report import markdown_head

    lines = markdown_head("LoRA launch floor of a decode step", payload["command"])
    env = payload["environment"]
    lines += [f"Environment: {env['device_name']}, torch {env['torch']}, triton {env['triton']}, {env['dtype']}, "
              f"PDL {'available' if env['pdl'] else 'unavailable'}.", ""] + table_lines(payload)
    return "\n".join(lines) + "\n"


def table_lines(floor: dict) -> list[str]:
    """The launch-floor table and the recorded grids (also a section of ``lora_kernels``' report)."""
    lines = [f"{floor['num_launches']} LoRA launches of one decode step ({floor['tokens']} tokens, rank "
             f"{floor['rank']}, {floor['layers']} layers; grids of the default plan for {floor['tokens']} distinct "
             f"adapters, {floor['programs_total']:,} programs in all), one CUDA graph, median replay. Stand-ins: "
             "`empty` returns at once; `chain` makes only the dependent loads each of our programs makes before its "
             "first multiply (chunk count, slot, weights at the slot, activations) and one store. The real kernels' "
             "metadata is built outside the graph.", "",
             "| launches | PDL | time (ms) | µs per launch |", "|---|---|---|---|"]
    for r in floor["rows"]:
        lines.append(f"| {r['launches']} | {r['pdl']} | {r['time_ms']:.3f} | {r['us_per_launch']:.2f} |")
    lines += ["", "Grids recorded (kind, grid, warps, PDL: launches):", ""]
    for g in floor["grids"]:
        lines.append(f"- {g['kind']} {tuple(g['grid'])}, {g['num_warps']} warps, PDL {g['pdl']}: {g['launches']}")
    return lines


def stand_in_ms(floor: dict, body: str) -> float | None:
    """The fastest run of a stand-in body (``empty`` or ``chain``) at the recorded grids, ms (None: not measured)."""
    return min((r["time_ms"] for r in floor.get("rows", []) if r["body"] == body and not r.get("grid_cap")),
               default=None)


def chain_floor_ms(floor: dict) -> float | None:
    """The fastest chain stand-in of a launch-floor run (ms): what these launches cost with no bytes to move."""
    return stand_in_ms(floor, "chain")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loraplex.bench.launch_floor", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="docs/benchmarks/launch-floor.json", help="JSON path (.md beside it)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU with TRITON_INTERPRET=1)")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--grid-caps", default="",
                        help="comma-separated program counts: the stand-ins again with at most that many programs a "
                             "launch (e.g. 132,528: one or four per SM of an H100 / H200)")
    args = parser.parse_args(argv)
    if args.tokens < 1 or args.rank < 1:
        parser.error("--tokens and --rank must be at least 1")
    try:
        grid_caps = [int(c) for c in args.grid_caps.split(",") if c.strip()]
    except ValueError:
        parser.error(f"--grid-caps: want comma-separated integers, got {args.grid_caps!r}")
    if any(c < 3 for c in grid_caps):
        parser.error("--grid-caps: each cap must be at least 3 (a program per slice)")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from loraplex.adapters.modules import BaseShapes
    from loraplex.bench.lora_kernels import LLAMA3_8B, SMOKE, cuda_or_smoke

    device = cuda_or_smoke(parser, args.smoke)
    if args.smoke:
        shapes, dtype, tokens, reps = BaseShapes.from_config(SMOKE), torch.float32, 4, 1
    else:
        shapes, dtype, tokens, reps = BaseShapes.from_config(LLAMA3_8B), torch.bfloat16, args.tokens, args.reps
    from loraplex.kernels.lora_shrink import pdl_supported

    payload = {"command": module_command("loraplex.bench.launch_floor", argv),
               "environment": {**kernel_environment(device, dtype), "pdl": pdl_supported(device)},
               **run(shapes, tokens, args.rank, device, dtype, reps, grid_caps)}
    write_json_and_markdown(args.out, payload, markdown(payload))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
