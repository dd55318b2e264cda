"""Write a benchmark result as JSON + a markdown report (tables + the exact command) to docs/benchmarks/."""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shlex
import sys
import time
from pathlib import Path

log = logging.getLogger("loraplex.bench")

DEFAULT_OUT_DIR = Path("docs/benchmarks")


def host_probe_ms(loops: int = 200_000, repeats: int = 3) -> float:
    """The best of ``repeats`` timings (ms) of a fixed pure-Python loop: how fast this host runs the engine's Python
    right now. A busy or throttled host shows here, beside figures that move for no reason of their own."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        total = 0
        for i in range(loops):
            total += i
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def host_state() -> dict:
    """``host_probe_ms`` and the 1-minute load average (None where the OS has none)."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {"host_probe_ms": host_probe_ms(), "load_1m": load}


def environment(device) -> dict:
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__, "device": str(device)}
    env["cpus"] = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    env.update({k: round(v, 2) for k, v in host_state().items() if v is not None})
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    if getattr(device, "type", str(device)).startswith("cuda"):
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, gpu_memory_gb=round(props.total_memory / 2**30, 1),
                   sm_count=props.multi_processor_count)
    return env


def kernel_environment(device, dtype) -> dict:
    """The environment line of a kernel benchmark's report: device name, torch, triton, dtype. Call it only after
    ``--smoke`` has chosen the interpreter (triton is imported here)."""
    import torch
    import triton

    return {"device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "triton": triton.__version__, "dtype": str(dtype).replace("torch.", "")}


def module_command(module: str, argv: list[str] | None = None) -> str:
    """``python -m <module> <args>`` as run (``argv``: the arguments a caller passed to ``main``, else sys.argv's)."""
    return f"python -m {module} " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))


def markdown_head(title: str, command: str) -> list[str]:
    """A report's first lines: its title and its exact command in a code block, then a blank line."""
    return [f"# {title}", "", "Command:", "", "```", command, "```", ""]


def write_json_and_markdown(out: str | Path, payload: dict, markdown: str) -> None:
    """``payload`` as JSON at ``out`` and ``markdown`` beside it (``.md``), creating the folder."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown)
    log.info("wrote %s and %s", out, out.with_suffix(".md"))


def command_line(args=None) -> str:
    """The command as typed when run as ``loraplex``; otherwise (called from Python) rebuilt from ``args``:
    the bench subcommand and every option whose value differs from its default."""
    if Path(sys.argv[0]).name == "loraplex" or args is None:
        return "loraplex " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    parser = getattr(args, "bench_parser", None)
    words = ["loraplex", "bench", args.bench_command]
    for action in parser._actions if parser else []:
        if not action.option_strings or action.dest == "help":
            continue
        value = getattr(args, action.dest, action.default)
        if value == action.default:
            continue
        flag = action.option_strings[-1]
        if isinstance(action, argparse.BooleanOptionalAction):  # --x / --no-x: the one that gives the value
            words.append(next(f for f in action.option_strings if f.startswith("--no-") != bool(value)))
        elif value is True:
            words.append(flag)
        else:
            text = ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
            words += [flag, text]
    return " ".join(shlex.quote(w) for w in words)


def fmt(value) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:.2f}" if abs(value) >= 1 else f"{value:.3g}"
    return str(value)


def table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    """Markdown table; ``columns`` = (key, header). Missing keys print as a dash."""
    head = "| " + " | ".join(h for _, h in columns) + " |"
    sep = "|" + "|".join("---" for _ in columns) + "|"
    body = ["| " + " | ".join(fmt(r.get(k)) for k, _ in columns) + " |" for r in rows]
    return "\n".join([head, sep, *body])


def utc_stamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime())


def write_report(
    name: str, result: dict, sections: list[tuple[str, str]], out_dir: str | Path | None = None, args=None,
    stamp: str | None = None,
) -> tuple[Path, Path]:
    """``sections``: (title, markdown body). Returns the JSON and markdown paths. ``stamp``: the UTC time in the
    file names (default now); a run that rewrites its report as it goes passes the same one each time."""
    out = Path(out_dir) if out_dir else DEFAULT_OUT_DIR
    out.mkdir(parents=True, exist_ok=True)
    stamp = stamp or utc_stamp()
    cmd = getattr(args, "report_command", None) or command_line(args)
    payload = {"name": name, "time_utc": stamp, "command": cmd, **result}
    json_path = out / f"{name}-{stamp}.json"
    md_path = out / f"{name}-{stamp}.md"
    json_path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    env = result.get("environment", {})
    lines = markdown_head(f"{name} ({stamp} UTC)", cmd)
    if env:
        lines += ["Environment: " + ", ".join(f"{k} {v}" for k, v in env.items()), ""]
    for title, body in sections:
        lines += [f"## {title}", "", body, ""]
    lines += [f"Raw figures: `{json_path.name}`.", ""]
    md_path.write_text("\n".join(lines))
    return json_path, md_path
