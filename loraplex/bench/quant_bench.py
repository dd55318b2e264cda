"""INT8 or FP8 weight-only linear (``kernels/w8a16.py``, ``--method``) against the 16-bit GEMM (cuBLAS through ``F.linear``) on the
projections of the Llama-3-8B shape, decode and prefill row counts, in the same run.

    python -m loraplex.bench.quant_bench [--out docs/benchmarks/quant_bench.json] [--smoke]

Per (projection, rows): microseconds of each, the weight bytes each must read over the measured copy bandwidth
(the floor of a decode-sized call), and the speed of int8 over 16-bit. The kernel's tiles come from
``w8a16.choose_blocks`` unless ``--sweep`` tries the alternatives too. ``--smoke``: tiny shapes on the CPU (the
Triton interpreter, fp32), which checks the harness only.
"""

from __future__ import annotations

import argparse
import logging
import sys

import torch
import torch.nn.functional as F

from loraplex.bench.report import markdown_head

log = logging.getLogger("loraplex.bench.quant_bench")

LLAMA3_8B = {"q|k|v": (4096, 6144), "o": (4096, 4096), "gate|up": (4096, 28672), "down": (14336, 4096)}
SMOKE = {"q|k|v": (64, 96), "down": (160, 64)}
ROWS = (1, 16, 64, 256, 2048)
# (BLOCK_M, BLOCK_N, BLOCK_K[, num_warps, num_stages, split_k]); decode-sized rows try split-K and deeper pipelines
SWEEP_DECODE = ((16, 32, 128), (16, 64, 128), (16, 64, 256), (16, 32, 256, 4, 4), (16, 64, 256, 4, 4),
                (16, 128, 128, 4, 4), (16, 64, 256, 4, 3, 2), (16, 64, 256, 4, 3, 4), (16, 128, 256, 8, 3, 4),
                (16, 32, 512, 4, 3, 2), (64, 32, 64), (64, 64, 128, 4, 4), (64, 64, 256, 4, 3, 2),
                (64, 128, 128, 8, 3, 4))
SWEEP_PREFILL = ((64, 64, 64), (64, 128, 64), (128, 128, 64), (128, 128, 64, 8, 3), (128, 256, 64, 8, 3),
                 (64, 128, 128, 4, 4))


def run(device: torch.device, dtype: torch.dtype, shapes: dict, rows: tuple[int, ...], iters: int,
        sweep: bool, method: str = "int8") -> dict:
    from loraplex.bench.roofline import measure_copy_bandwidth
    from loraplex.bench.timing import time_per_call_graphed as time_per_call
    from loraplex.engine.quant import QUANTIZERS
    from loraplex.kernels.w8a16 import w8a16_linear, w8a16_linear_ref

    bandwidth = measure_copy_bandwidth(device, nbytes=(1 << 30) if device.type == "cuda" else 1 << 22)
    gen = torch.Generator(device=device).manual_seed(0)
    out = {"copy_bandwidth_Bps": bandwidth, "method": method, "rows": []}
    for name, (k, n) in shapes.items():
        w = (torch.randn(n, k, device=device, generator=gen) * 0.02).to(dtype)
        q = QUANTIZERS[method](w)
        for m in rows:
            x = torch.randn(m, k, device=device, generator=gen).to(dtype)
            err = (w8a16_linear(x, q.qweight, q.scale).float()
                   - w8a16_linear_ref(x, q.qweight, q.scale).float()).abs().max().item()
            t16 = time_per_call(lambda x=x, w=w: F.linear(x, w), device, iters=iters)
            t8 = time_per_call(lambda x=x, q=q: w8a16_linear(x, q.qweight, q.scale), device, iters=iters)
            row = {"proj": name, "k": k, "n": n, "rows": m, "us_16bit": t16 * 1e6, "us_int8": t8 * 1e6,
                   "int8_speedup": t16 / t8, "max_abs_err_vs_twin": err,
                   "floor_us_16bit": w.numel() * w.element_size() / bandwidth * 1e6,
                   "floor_us_int8": q.nbytes() / bandwidth * 1e6}
            if sweep:
                best = None
                for blocks in (SWEEP_DECODE if m <= 64 else SWEEP_PREFILL):
                    try:
                        tb = time_per_call(lambda b=blocks, x=x, q=q: w8a16_linear(x, q.qweight, q.scale, blocks=b),
                                           device, iters=iters)
                    except Exception as exc:  # noqa: BLE001 - a tile the compiler refuses: skip it
                        log.info("blocks %s failed: %s", blocks, exc)
                        continue
                    if best is None or tb < best[1]:
                        best = (blocks, tb)
                if best:
                    row.update({"best_blocks": list(best[0]), "us_int8_best": best[1] * 1e6})
            out["rows"].append(row)
            log.info("QUANT %s", row)
    return out


def markdown(payload: dict) -> str:
    lines = [*markdown_head(f"{payload['method'].upper()} weight-only linear vs the 16-bit GEMM", payload["command"]),
             f"Environment: {payload['environment']}. Copy bandwidth {payload['copy_bandwidth_Bps'] / 1e12:.2f} TB/s. "
             "Floors: the weight bytes each call must read over that bandwidth. Times: the calls captured back to back in one "
             "CUDA graph (device time, not the host's launch cost).", "",
             "| projection | rows | 16-bit us | 8-bit us | 8-bit speedup | floor 16-bit us | floor 8-bit us | best tiles | "
             "best 8-bit us | max abs err vs twin |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in payload["rows"]:
        best = (f"{r['best_blocks']} | {r['us_int8_best']:.1f}" if "us_int8_best" in r else "— | —")
        lines.append(f"| {r['proj']} ({r['k']} -> {r['n']}) | {r['rows']} | {r['us_16bit']:.1f} | {r['us_int8']:.1f} | "
                     f"{r['int8_speedup']:.2f} | {r['floor_us_16bit']:.1f} | {r['floor_us_int8']:.1f} | {best} | "
                     f"{r['max_abs_err_vs_twin']:.3g} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loraplex.bench.quant_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="docs/benchmarks/quant_bench.json", help="JSON path (.md beside it)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (TRITON_INTERPRET=1)")
    parser.add_argument("--sweep", action="store_true", help="also try other tiles per shape")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--method", choices=("int8", "fp8"), default="int8", help="the weights' 8-bit type")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes, rows = (SMOKE, (1, 20)) if args.smoke else (LLAMA3_8B, ROWS)
    payload = run(device, dtype, shapes, rows, 2 if args.smoke else args.iters, args.sweep, args.method)
    import triton

    from loraplex.bench.report import module_command, write_json_and_markdown

    payload["command"] = module_command("loraplex.bench.quant_bench", argv)
    payload["environment"] = (f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu (interpreter)'}, "
                              f"torch {torch.__version__}, triton {triton.__version__}, {str(dtype).removeprefix('torch.')}")
    write_json_and_markdown(args.out, payload, markdown(payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
