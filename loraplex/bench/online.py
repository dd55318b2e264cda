"""``loraplex bench online``: Poisson arrivals at rate R through the OpenAI-compatible HTTP API.

Each request streams ``/v1/completions`` (SSE, ``stream_options.include_usage``, ``ignore_eos``, greedy).
Per request: TTFT (send → first token chunk), ITL (gaps between token chunks), TPOT ((E2E − TTFT) ÷
(output tokens − 1)) and E2E latency. Reported: p50/p90/p99 and mean of each, output throughput, and
goodput = requests per second that met both SLOs (TTFT ≤ --slo-ttft-ms and TPOT ≤ --slo-tpot-ms).
Module-level imports stay light: ``loraplex bench --help`` imports this file.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import tempfile
import time
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


@dataclass
class RequestRecord:
    start: float
    first_token: float | None = None
    end: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.start

    @property
    def e2e(self) -> float | None:
        return None if self.end is None else self.end - self.start

    @property
    def tpot(self) -> float | None:
        if self.end is None or self.first_token is None or self.output_tokens < 2:
            return None
        return (self.end - self.first_token) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile, q in [0, 100]."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _dist(values: list[float]) -> dict:
    return {"mean": sum(values) / len(values) if values else None, "p50": percentile(values, 50),
            "p90": percentile(values, 90), "p99": percentile(values, 99), "count": len(values)}


def summarize(records: list[RequestRecord], duration: float, slo_ttft: float, slo_tpot: float) -> dict:
    ok = [r for r in records if r.error is None and r.end is not None]
    good = [r for r in ok if r.ttft is not None and r.ttft <= slo_ttft and (r.tpot is None or r.tpot <= slo_tpot)]
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "num_requests": len(records), "completed": len(ok), "failed": len(records) - len(ok),
        "duration_s": duration, "output_tokens": out_tokens,
        "output_tok_per_s": out_tokens / duration if duration else None,
        "req_per_s": len(ok) / duration if duration else None,
        "goodput_req_per_s": len(good) / duration if duration else None,
        "slo_ttft_s": slo_ttft, "slo_tpot_s": slo_tpot,
        "ttft_s": _dist([r.ttft for r in ok if r.ttft is not None]),
        "tpot_s": _dist([r.tpot for r in ok if r.tpot is not None]),
        "itl_s": _dist([x for r in ok for x in r.itls]),
        "e2e_s": _dist([r.e2e for r in ok if r.e2e is not None]),
        "errors": sorted({r.error for r in records if r.error})[:5],
    }


def poisson_offsets(n: int, rate: float, rng: random.Random) -> list[float]:
    """Send times (s from the start) of n requests arriving as a Poisson process; rate inf = all at once."""
    if rate == float("inf"):
        return [0.0] * n
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def note_chunk(record: RequestRecord, chunk: dict, now: float) -> None:
    """Account one streamed completion chunk. A chunk carries tokens when its choices list some in ``logprobs``
    (the bench asks for ``logprobs: 0``) or have text: a token whose text is held back (part of a UTF-8
    character, frequent with random weights) still arrives in a chunk with empty text and its logprob, so
    TTFT and ITL time the tokens themselves, not the first visible text."""
    if chunk.get("usage"):
        record.output_tokens = chunk["usage"].get("completion_tokens", record.output_tokens)
        record.prompt_tokens = chunk["usage"].get("prompt_tokens", 0)
    if any(c.get("text") or ((c.get("logprobs") or {}).get("tokens")) for c in chunk.get("choices") or []):
        if record.first_token is None:
            record.first_token = now
        record.chunk_times.append(now)


async def _one(client, url: str, headers: dict, body: dict, record: RequestRecord) -> None:
    try:
        async with client.stream("POST", url, headers=headers, json=body) as resp:
            if resp.status_code != 200:
                record.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                note_chunk(record, json.loads(data), time.perf_counter())
        record.end = time.perf_counter()
        if not record.output_tokens:
            record.output_tokens = len(record.chunk_times)
    except Exception as exc:  # a failed request is counted, never fatal to the run
        record.error = f"{type(exc).__name__}: {exc}"


async def run_online(
    base_url: str, api_key: str | None, models: list[str], prompts: list, output_lens: list[int], rate: float,
    seed: int = 0, timeout_s: float = 600.0,
) -> tuple[list[RequestRecord], float]:
    """Send ``prompts[i]`` (text or token ids) to ``models[i]`` at Poisson times; returns records + duration."""
    import asyncio

    import httpx

    url = base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    offsets = poisson_offsets(len(prompts), rate, random.Random(seed))
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        start = time.perf_counter()
        tasks, records = [], []
        for offset, model, prompt, out_len in zip(offsets, models, prompts, output_lens):
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            # logprobs 0: every token's chunk is sent, also when its text is held back (note_chunk)
            body = {"model": model, "prompt": prompt, "max_tokens": out_len, "temperature": 0.0, "logprobs": 0,
                    "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
            record = RequestRecord(start=time.perf_counter())
            records.append(record)
            tasks.append(asyncio.create_task(_one(client, url, headers, body, record)))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return records, duration


def add_online_args(p) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    p.add_argument("--api-key", default=os.environ.get("LORAPLEX_API_KEY"), help="env LORAPLEX_API_KEY")
    p.add_argument("--model", default=None, help="served base model name (default with --launch: the server's)")
    p.add_argument("--adapters", default="", help="comma-separated served adapter names used by --popularity")
    p.add_argument("--popularity", default="base", choices=("base", "identical", "zipf", "uniform", "distinct"),
                   help="which adapter each request names; adapter k is the (k mod n)-th of --adapters")
    p.add_argument("--rate", type=float, default=4.0, help="requests per second (inf = all at once)")
    p.add_argument("--num-requests", type=int, default=200)
    p.add_argument("--input-len", type=int, default=512, help="prompt tokens (sent as token ids)")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--len-dist", default="fixed", choices=("fixed", "uniform", "exponential"))
    p.add_argument("--vocab-size", type=int, default=None, help="prompt token ids are drawn below this "
                                                                "(default: the model's with --launch, else 512)")
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=100.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup-requests", type=int, default=4,
                   help="sent at once before the measured run (not counted): the server compiles its kernels")
    launch = p.add_argument_group("--launch: start loraplex serve here (own data dir, free port) and upload adapters")
    launch.add_argument("--launch", action="store_true")
    launch.add_argument("--model-dir", default=None, help="HF directory to serve (default: the random "
                                                          "Llama-3-8B-shaped model of bench offline)")
    launch.add_argument("--work-dir", default=os.path.join(tempfile.gettempdir(), "loraplex-bench"))
    launch.add_argument("--layers", type=int, default=32)
    launch.add_argument("--dtype", default="bfloat16")
    launch.add_argument("--rank", type=int, default=16)
    launch.add_argument("--num-adapters", type=int, default=16, help="adapters uploaded (with --popularity)")
    launch.add_argument("--max-loras", type=int, default=64)
    launch.add_argument("--max-num-seqs", type=int, default=256)
    launch.add_argument("--serve-env", action="append", default=[], metavar="LORAPLEX_NAME=VALUE",
                        help="a server setting for the launched server (repeatable), e.g. "
                             "LORAPLEX_LOOP_TORCH_THREADS=1; its data dir, address, database and Redis stay the bench's")


LOOP_COUNTERS = ("loraplex:engine_loop_steps_total", "loraplex:engine_loop_step_seconds_total",
                 "loraplex:engine_loop_dispatch_seconds_total", "loraplex:engine_loop_step_cpu_seconds_total",
                 "loraplex:engine_device_wait_seconds_total", "loraplex:engine_step_sequences_total",
                 "loraplex:engine_prompt_steps_total")


def loop_counters(url: str) -> dict[str, float] | None:
    """The server's engine-loop counters from ``/metrics`` (None when it cannot be read: another server, or
    metrics not reachable from here). ``LORAPLEX_METRICS_TOKEN`` in this environment is sent as the bearer token
    (a server that requires one)."""
    import os

    import httpx

    token = os.environ.get("LORAPLEX_METRICS_TOKEN")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        text = httpx.get(url.rstrip("/") + "/metrics", timeout=5.0, headers=headers).text
    except httpx.HTTPError:
        return None
    found = {}
    for line in text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in LOOP_COUNTERS:
            found[name] = found.get(name, 0.0) + float(line.split()[-1])
    return found if len(found) == len(LOOP_COUNTERS) else None


def loop_delta(before: dict | None, after: dict | None, wall_s: float) -> dict | None:
    """What the server's engine loop did during the measured run: steps, time per step inside engine.step() and
    handing out deltas, and the share of the run's wall time it was busy (the rest: waiting for work)."""
    if not before or not after or wall_s <= 0:
        return None
    steps, step_s, dispatch_s, cpu_s, device_s, seqs, prompt_steps = (after[name] - before[name]
                                                                      for name in LOOP_COUNTERS)

    def per_step(x: float) -> float | None:
        return x / steps * 1e3 if steps else None

    # inside a step: the loop's own CPU time (its thread's); its waits for the device (CUDA's synchronization spins, so on a
    # GPU these are inside the CPU time: H200 run 21, offline, CPU time equalled the wall time); and the time off a
    # CPU (in a thread of the server: waiting for the GIL while the HTTP event loop holds it; or for the OS)
    return {"steps": int(steps), "steps_per_s": steps / wall_s, "step_ms": per_step(step_s),
            "step_cpu_ms": per_step(cpu_s), "device_wait_ms": per_step(device_s),
            "other_wait_ms": per_step(max(0.0, step_s - cpu_s)),
            "dispatch_ms": per_step(dispatch_s), "busy_share": (step_s + dispatch_s) / wall_s,
            # the regime the server ran in: its mean batch, and how many steps carried prompt chunks (eager steps)
            "seqs_per_step": seqs / steps if steps else None,
            "prompt_step_share": prompt_steps / steps if steps else None}


def _launch(args, device):
    """Start a server on the model of ``bench offline`` and upload adapters; fills args.url/api_key/model/adapters."""
    import json
    from argparse import Namespace
    from pathlib import Path

    from loraplex.bench.llama8b import write_adapter_pool
    from loraplex.bench.offline_run import prepare_model
    from loraplex.bench.server_launch import launch_server

    model_dir = prepare_model(Namespace(model=args.model_dir, smoke=args.smoke, work_dir=args.work_dir,
                                        layers=args.layers), device)
    env = {}
    for item in getattr(args, "serve_env", None) or []:
        name, sep, value = item.partition("=")
        if not sep or not name.startswith("LORAPLEX_"):
            raise SystemExit(f"--serve-env: expected LORAPLEX_NAME=VALUE, got {item!r}")
        env[name] = value
    serve_args = ["--device", device.type, "--dtype", args.dtype, "--enable-lora", "--max-loras",
                  str(args.max_loras), "--max-lora-rank", str(args.rank), "--max-num-seqs", str(args.max_num_seqs)]
    started = time.perf_counter()
    server = launch_server(model_dir, serve_args, env=env)
    server.timings["start_s"] = time.perf_counter() - started
    from loraplex.settings import Settings

    # where the server ran its engine loop (Settings.engine_process, as the server read it from its environment)
    server.timings["engine_mode"] = "process" if Settings.from_env({**os.environ, **env}).engine_process else "thread"
    log.info("online: loraplex serve ready in %.1f s (pid %d, data dir %s)", server.timings["start_s"],
             server.proc.pid, server.data_dir)
    try:
        args.url, args.api_key = server.base_url, server.admin_key
        args.model = args.model or server.base_model()
        if args.popularity != "base" and not args.adapters:
            pool = write_adapter_pool(model_dir, args.num_adapters, args.rank, device)
            started = time.perf_counter()
            args.adapters = ",".join(server.upload_adapter(d, f"bench-{i}") for i, d in enumerate(pool))
            server.timings["upload_s"] = time.perf_counter() - started
            log.info("online: uploaded %d adapters in %.1f s", len(pool), server.timings["upload_s"])
        if args.vocab_size is None:
            args.vocab_size = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    except BaseException:
        server.stop()
        raise
    return server


def collect_online(args, device) -> dict:
    """Run the online benchmark (launching a server first with ``args.launch``); returns its raw figures."""
    import asyncio

    from loraplex.bench.workload import make_requests

    server = _launch(args, device) if args.launch else None
    launched = None
    try:
        if not args.model:
            raise SystemExit("--model is required: the served base model name (GET /v1/models lists it)")
        adapters = [a for a in args.adapters.split(",") if a]
        if args.popularity != "base" and not adapters:
            raise SystemExit(f"--popularity {args.popularity} needs --adapters (served adapter names)")
        reqs = make_requests(args.num_requests, args.input_len, args.output_len, args.popularity,
                             args.vocab_size or 512, args.seed, args.len_dist)
        models = [args.model if r.adapter is None else adapters[r.adapter % len(adapters)] for r in reqs]
        warmup = getattr(args, "warmup_requests", 0)
        if warmup:
            started = time.perf_counter()
            warm, _ = asyncio.run(run_online(
                args.url, args.api_key, models[:warmup], [r.prompt_token_ids for r in reqs[:warmup]],
                [min(4, r.output_len) for r in reqs[:warmup]], float("inf"), seed=args.seed))
            log.info("online: %d warm-up requests in %.1f s (%d failed)", len(warm), time.perf_counter() - started,
                     sum(r.error is not None for r in warm))
        before = loop_counters(args.url)
        records, duration = asyncio.run(run_online(
            args.url, args.api_key, models, [r.prompt_token_ids for r in reqs], [r.output_len for r in reqs],
            args.rate, seed=args.seed))
        loop = loop_delta(before, loop_counters(args.url), duration)
    finally:
        if server is not None:
            launched = {**server.timings, **server.stop()}
            launched.update(server.embedded_state())
            shutil.rmtree(server.data_dir, ignore_errors=True)
            log.info("online: server stopped (exit code %s, %.1f s to drain)", launched["exit_code"],
                     launched["stop_s"])
    summary = summarize(records, duration, args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)
    log.info("online: %d of %d requests completed in %.1f s, %.1f output tok/s, goodput %.2f req/s",
             summary["completed"], summary["num_requests"], duration, summary["output_tok_per_s"] or 0,
             summary["goodput_req_per_s"] or 0)
    rate = args.rate if args.rate != float("inf") else "inf"  # JSON has no infinity
    return {"url": args.url, "rate": rate, "popularity": args.popularity, "adapters": adapters,
            "input_len": args.input_len, "output_len": args.output_len, "launched": server is not None,
            "warmup_requests": getattr(args, "warmup_requests", 0), "server": launched, "summary": summary,
            "engine_loop": loop, "serve_env": getattr(args, "serve_env", None) or []}


def run_online_cli(args) -> int:
    import signal

    import torch

    from loraplex.bench.full import CutShort, _cut_short
    from loraplex.bench.report import command_line, write_report
    from loraplex.bench.sections import online_section

    args.report_command = command_line(args)
    if args.smoke:  # a tiny model served on the CPU: checks the whole path in seconds
        args.launch, args.layers, args.dtype, args.rank = True, 2, "float32", 8
        args.num_requests, args.input_len, args.output_len = min(args.num_requests, 6), 8, 4
        args.num_adapters, args.max_loras, args.max_num_seqs = 2, 4, 8
        args.rate = float("inf") if args.rate == 4.0 else args.rate
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() and not args.smoke else "cpu"))
    # SIGTERM (e.g. ``timeout``) unwinds like Ctrl-C, so the server this run launched is stopped, not left running
    # on the GPU under the next run
    previous = signal.signal(signal.SIGTERM, _cut_short)
    try:
        result = collect_online(args, device)
    except CutShort as exc:
        log.warning("online: stopped by %s; no report written", exc)
        return 3
    finally:
        signal.signal(signal.SIGTERM, previous)
    out_dir = args.out_dir or (tempfile.mkdtemp(prefix="loraplex-bench-smoke-") if args.smoke else None)
    json_path, md_path = write_report("online", result, [online_section(result)], out_dir, args)
    print(md_path.read_text())
    print(f"wrote {json_path} and {md_path}")
    return 0 if result["summary"]["completed"] else 1
