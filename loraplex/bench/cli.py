"""``loraplex bench attention|offline|online|all|step-profile|host-overhead``: each writes JSON + markdown to docs/benchmarks/.

``--smoke`` runs any of them on the CPU in seconds with tiny shapes (the tiny demo model for the
engine, the Triton interpreter for the kernels) so the harness itself is tested without a GPU.
"""

from __future__ import annotations

import logging
import os
import tempfile

from loraplex.bench.report import command_line

log = logging.getLogger(__name__)


def _csv_ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def _csv(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def register(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks: attention, offline throughput, online serving")
    sub = bench.add_subparsers(dest="bench_command", metavar="BENCH")

    def common(p):
        p.add_argument("--device", default=None, help="cuda (default when available) or cpu")
        p.add_argument("--out-dir", default=None, help="report directory (default docs/benchmarks; a temp dir "
                                                       "under --smoke)")
        p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks the harness only")

    att = sub.add_parser("attention", help="paged decode attention vs torch SDPA(enable_gqa) on contiguous KV")
    common(att)
    att.add_argument("--batch", type=int, default=64)
    att.add_argument("--contexts", type=_csv_ints, default=(1024, 2048, 4096), help="comma-separated")
    att.add_argument("--iters", type=int, default=50)
    att.add_argument("--sweep", action="store_true", help="also try tile/split configs; report the fastest")
    att.add_argument("--fp8-kv", action="store_true",
                     help="also time the decode kernel over a float8 e4m3 copy of each cache (kv_cache_dtype=fp8)")
    att.set_defaults(func=_run_attention, bench_parser=att)

    off = sub.add_parser("offline", help="throughput by adapter popularity, decode step vs roofline, HF+PEFT peer")
    common(off)
    add_offline_args(off)
    off.set_defaults(func=_run_offline, bench_parser=off)

    full = sub.add_parser("all", help="every issue-9 figure in one run and one report: attention, LoRA kernels, "
                                      "offline throughput, decode step vs roofline, HF+PEFT peer")
    common(full)
    add_offline_args(full)
    full.add_argument("--attn-batch", type=int, default=64)
    full.add_argument("--contexts", type=_csv_ints, default=(1024, 2048, 4096), help="attention contexts")
    full.add_argument("--attn-iters", type=int, default=50)
    full.add_argument("--sweep", action="store_true", help="attention and LoRA kernels: also try launch configs")
    full.add_argument("--skip-lora-kernels", action="store_true")
    full.add_argument("--online-rate", type=float, default=0.0,
                      help="also serve the model over HTTP and send Poisson arrivals at this rate (0 = skip)")
    full.add_argument("--online-requests", type=int, default=200)
    full.add_argument("--online-adapters", type=int, default=16, help="adapters uploaded to the launched server")
    full.add_argument("--online-warmup-requests", type=int, default=4, help="sent before the measured online run")
    full.add_argument("--online-serve-env", action="append", default=[], metavar="LORAPLEX_NAME=VALUE",
                      help="a setting for the launched server (repeatable), as bench online --serve-env")
    full.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    full.add_argument("--slo-tpot-ms", type=float, default=100.0)
    full.set_defaults(func=_run_full, bench_parser=full, peer="hf-peft")

    onl = sub.add_parser("online", help="Poisson arrivals through the HTTP API: TTFT, TPOT, ITL, E2E, goodput")
    common(onl)
    from loraplex.bench.online import add_online_args, run_online_cli

    add_online_args(onl)
    onl.set_defaults(func=run_online_cli, bench_parser=onl)

    from loraplex.bench.step_profile import add_step_profile_args

    prof = sub.add_parser("step-profile", help="one decode step phase by phase (host) and kernel by kernel "
                                               "(torch.profiler): GPU time by category, GPU idle, launches")
    common(prof)
    add_step_profile_args(prof)
    prof.set_defaults(func=_run_step_profile, bench_parser=prof)

    from loraplex.bench.host_overhead import add_host_overhead_args, run_host_overhead_cli

    host = sub.add_parser("host-overhead", help="host time per decode step at N running requests (CPU, model "
                                                "excluded): schedule / prepare / sample / update")
    add_host_overhead_args(host)
    host.set_defaults(func=run_host_overhead_cli, bench_parser=host)
    bench.set_defaults(func=lambda args: (bench.print_help(), 2)[1])


def add_offline_args(p) -> None:
    from loraplex.bench.engine_flags import OFFLINE, add_flags

    p.add_argument("--model", default=None, help="HF model directory (default: a random Llama-3-8B-shaped "
                                                   "model written under --work-dir)")
    p.add_argument("--work-dir", default=os.path.join(tempfile.gettempdir(), "loraplex-bench"))
    p.add_argument("--layers", type=int, default=32, help="layers of the random Llama-3-8B-shaped model")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--len-dist", default="fixed", choices=("fixed", "uniform", "exponential"))
    p.add_argument("--popularity", type=_csv, default=["base", "identical", "zipf", "uniform", "distinct"])
    p.add_argument("--repeats", type=int, default=1,
                   help="rounds of the popularity list: each ratio is taken against its own round's base and the "
                        "report gives the median round with the spread")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank (all seven projections)")
    p.add_argument("--num-adapter-files", type=int, default=16, help="adapter k reads file k %% this")
    p.add_argument("--max-loras", type=int, default=256, help="GPU adapter slots")
    p.add_argument("--max-cpu-loras", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--step-batch", type=int, default=64, help="decode-step timing: batch (0 = skip)")
    p.add_argument("--step-context", type=int, default=1024)
    p.add_argument("--step-count", type=int, default=64)
    p.add_argument("--peer", default="none", choices=("none", "hf-peft"))
    p.add_argument("--peer-requests", type=int, default=32)
    p.add_argument("--peer-batch", type=int, default=32)
    p.add_argument("--peer-adapters", type=int, default=8)
    p.add_argument("--peer-output-len", type=int, default=None, help="default: --output-len")
    p.add_argument("--seed", type=int, default=0)
    add_flags(p, OFFLINE[:-1])  # the engine options (bench/engine_flags.py), then --tensor-parallel-size
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="engine option tensor_parallel_size: the model over this many GPUs (CPU processes with "
                        "--smoke); the floors then count that many times GPU 0's measured copy bandwidth and matmul "
                        "rate, and the single-runner decode-step timing (--step-batch) is skipped")
    add_flags(p, OFFLINE[-1:])


def _device(args):
    import torch

    if args.smoke:
        return torch.device(args.device or "cpu")
    return torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))


def _out_dir(args) -> str | None:
    if args.out_dir is None and args.smoke:
        return tempfile.mkdtemp(prefix="loraplex-bench-smoke-")
    return args.out_dir


def _run_attention(args) -> int:
    args.report_command = command_line(args)
    device = _device(args)
    if device.type != "cuda":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported
    import torch

    from loraplex.bench.attention_bench import run_attention_bench
    from loraplex.bench.report import environment, write_report
    from loraplex.bench.sections import attention_section

    if args.smoke:
        result = run_attention_bench(device, batch=2, contexts=(37, 100), dtype=torch.float32, iters=1,
                                     warmup=0, prefill=(2, 20), num_q_heads=8, num_kv_heads=2, head_dim=32,
                                     fp8_kv=args.fp8_kv)
    else:
        result = run_attention_bench(device, batch=args.batch, contexts=args.contexts, iters=args.iters,
                                     sweep=args.sweep, fp8_kv=args.fp8_kv)
    result["environment"] = environment(device)
    json_path, md_path = write_report("attention", result, [attention_section(result)], _out_dir(args), args)
    print(md_path.read_text())
    print(f"wrote {json_path} and {md_path}")
    return 0


def _run_full(args) -> int:
    args.report_command = command_line(args)
    device = _device(args)
    if device.type != "cuda":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported
    from loraplex.bench.full import run_full

    return run_full(args, device, _out_dir(args))


def _run_step_profile(args) -> int:
    args.report_command = command_line(args)  # before --smoke rewrites the settings
    device = _device(args)
    if device.type != "cuda":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported
    from loraplex.bench.step_profile import run_step_profile_cli

    return run_step_profile_cli(args, device, _out_dir(args))


def _run_offline(args) -> int:
    args.report_command = command_line(args)  # before --smoke rewrites the settings
    from loraplex.bench.offline_run import run_offline_bench

    return run_offline_bench(args, _device(args), _out_dir(args))
