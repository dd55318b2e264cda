"""``loraplex serve``: uvicorn, run programmatically, with a draining SIGTERM.

On SIGTERM (or Ctrl-C): ``/ready`` turns 503, the listening socket closes (new connections are
refused), in-flight requests and streams finish within ``drain_timeout_s`` (what still runs then is ended
with a 503 ``draining``), then the engine stops and the process exits 0. A second Ctrl-C quits at once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import logging
import math
import re
import socket
import sys
from pathlib import Path

from loraplex.engine.config import DTYPES, KV_CACHE_DTYPES
from loraplex.log import LOG_FORMATS, set_log_format
from loraplex.platform.cli import (
    FlagError,
    add_common,
    check_int,
    check_seconds,
    check_services,
    flag_checked,
    settings_from_args,
)
from loraplex.settings import ConfigError, Settings

log = logging.getLogger(__name__)
DEFAULTS = Settings()  # shown in --help


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "serve", help="run the API server (no arguments: embedded default with a demo model)",
    )
    p.add_argument("model", nargs="?", help="a Llama-family HF model directory (default: demo model in data dir)")
    p.add_argument("--host", help="bind address (env LORAPLEX_HOST, default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (env LORAPLEX_PORT, default 8000; 0 = any free port)")
    add_common(p)
    p.add_argument("--enable-lora", action=argparse.BooleanOptionalAction, default=None,
                   help="serve adapters (env LORAPLEX_ENABLE_LORA, default on)")
    p.add_argument("--max-loras", type=int, help=f"adapters in one step: GPU slots (env LORAPLEX_MAX_LORAS, default {DEFAULTS.max_loras:g})")
    p.add_argument("--max-lora-rank", type=int, help="largest adapter rank accepted (env LORAPLEX_MAX_LORA_RANK, "
                   f"default {DEFAULTS.max_lora_rank:g})")
    p.add_argument("--max-cpu-loras", type=int, help="adapters kept in host memory (env LORAPLEX_MAX_CPU_LORAS, "
                   f"default {DEFAULTS.max_cpu_loras:g})")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                   help="run the engine's step loop in a process of its own, so the HTTP server and the engine never "
                        "share a GIL (env LORAPLEX_ENGINE_PROCESS, default on; --no-engine-process runs it in a "
                        "thread of the server)")
    p.add_argument("--merge-single-lora", action=argparse.BooleanOptionalAction, default=None,
                   help="while every running request uses one adapter, fold it into the weights and run the base "
                        "model (env LORAPLEX_MERGE_SINGLE_LORA, default off; keeps a copy of the projection "
                        "weights on the GPU)")
    p.add_argument("--lora-gemm-shrink", action=argparse.BooleanOptionalAction, default=None,
                   help="decode steps of up to --lora-gemm-shrink-max-tokens tokens compute the LoRA shrink inside "
                        "the base GEMM, over the first GPU slots (4, 8, ... max_loras) that their adapters fill half "
                        "of (env LORAPLEX_LORA_GEMM_SHRINK, default off; docs/engine.md)")
    p.add_argument("--lora-gemm-shrink-max-tokens", type=int,
                   help="largest decode step for --lora-gemm-shrink (env LORAPLEX_LORA_GEMM_SHRINK_MAX_TOKENS, "
                        f"default {DEFAULTS.lora_gemm_shrink_max_tokens:g})")
    p.add_argument("--lora-gemm-shrink-max-moves", type=int,
                   help="adapters a decode step may move into the first GPU slots for --lora-gemm-shrink, 0: never "
                        f"(env LORAPLEX_LORA_GEMM_SHRINK_MAX_MOVES, default {DEFAULTS.lora_gemm_shrink_max_moves:g})")
    p.add_argument("--device", help="auto | cpu | cuda (env LORAPLEX_DEVICE, default auto)")
    p.add_argument("--dtype", help="auto | float32 | bfloat16 | float16 (env LORAPLEX_DTYPE, default auto)")
    p.add_argument("--max-model-len", type=int, help="context length (env LORAPLEX_MAX_MODEL_LEN, default: the "
                   "model's)")
    p.add_argument("--max-num-seqs", type=int, help=f"requests in one step (env LORAPLEX_MAX_NUM_SEQS, default {DEFAULTS.max_num_seqs:g})")
    p.add_argument("--kv-cache-dtype",
                   help="KV-cache element type (env LORAPLEX_KV_CACHE_DTYPE, default auto: the model's dtype; fp8: "
                        "float8 e4m3, half the memory per token of bf16; int8: int8 with a scale per token and head)")
    p.add_argument("--quantization",
                   help="base weights: int8 or fp8 (e4m3) weight-only, one scale per output row, half the weight "
                        "memory of bf16 (env LORAPLEX_QUANTIZATION, default: as stored)")
    p.add_argument("--num-speculative-tokens", type=int,
                   help="speculative decoding: up to this many prompt-lookup draft tokens per sequence and step, "
                        "verified in the same step (env LORAPLEX_NUM_SPECULATIVE_TOKENS, default 0: off)")
    p.add_argument("--tensor-parallel-size", type=int,
                   help="split the model over this many GPUs (cuda:0..N-1; NCCL) or CPU processes "
                        "(env LORAPLEX_TENSOR_PARALLEL_SIZE, default 1)")
    p.add_argument("--num-kv-blocks", type=int, help="KV-cache blocks (env LORAPLEX_NUM_KV_BLOCKS, default: sized "
                   "from free memory)")
    p.add_argument("--log-format", choices=LOG_FORMATS,
                   help="text, or json: one JSON object a line with ts, level, logger, message, and request_id and "
                        "tenant on lines logged while a request runs (env LORAPLEX_LOG_FORMAT, default text)")
    p.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=None,
                   help="one loraplex.access line a request: method, path without the query string, status, "
                        "duration, request id, tenant, completion id (env LORAPLEX_ACCESS_LOG, default off)")
    p.add_argument("--drain-timeout-s", type=float, help="how long SIGTERM waits for in-flight requests "
                   f"(env LORAPLEX_DRAIN_TIMEOUT_S, default {DEFAULTS.drain_timeout_s:g})")
    p.add_argument("--engine-stall-timeout-s", type=float,
                   help="an engine process that sends nothing for this long (it beats every second when idle) is "
                        "killed and replaced; /ready is 503 after a quarter of it; 0: never (env "
                        f"LORAPLEX_ENGINE_STALL_TIMEOUT_S, default {DEFAULTS.engine_stall_timeout_s:g})")
    p.set_defaults(func=flag_checked(serve))


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from loraplex.platform.app import create_app

    settings = settings_from_args(
        args, model=args.model, host=args.host, port=args.port, enable_lora=args.enable_lora,
        max_loras=args.max_loras, max_lora_rank=args.max_lora_rank, max_cpu_loras=args.max_cpu_loras,
        merge_single_lora=args.merge_single_lora, engine_process=args.engine_process,
        lora_gemm_shrink=args.lora_gemm_shrink,
        lora_gemm_shrink_max_tokens=args.lora_gemm_shrink_max_tokens,
        lora_gemm_shrink_max_moves=args.lora_gemm_shrink_max_moves, device=args.device, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        num_kv_blocks=args.num_kv_blocks, drain_timeout_s=args.drain_timeout_s,
        engine_stall_timeout_s=args.engine_stall_timeout_s,
        num_speculative_tokens=args.num_speculative_tokens, quantization=args.quantization,
        tensor_parallel_size=args.tensor_parallel_size, log_format=args.log_format, access_log=args.access_log,
    )
    set_log_format(settings.log_format)  # first: every line from here on is in the chosen format

    check_serve_settings(settings)
    warn_open_metrics(settings)
    if settings.model and not Path(settings.model).is_dir():
        raise ConfigError(f"model directory {settings.model} does not exist (MODEL / LORAPLEX_MODEL: a "
                          "Llama-family Hugging Face directory; leave it out for the demo model)")
    # the port and the services are checked before anything is written (a bootstrap key printed by a
    # server that then cannot listen would be lost in a log)
    sock = _bind(settings)
    if settings.gil_switch_interval_ms > 0:
        sys.setswitchinterval(settings.gil_switch_interval_ms / 1e3)
    try:
        asyncio.run(check_services(settings))

        def show_key(key: str) -> None:
            # stdout, once: the only time this key is ever shown
            print(f"Bootstrap admin key (shown once, store it now): {key}", flush=True)

        app = create_app(settings, on_bootstrap_key=show_key, freeze_gc=settings.freeze_gc)
        config = uvicorn.Config(
            app, host=settings.host, port=settings.port, lifespan="on", log_config=None,
            timeout_graceful_shutdown=math.ceil(settings.drain_timeout_s + DRAIN_GRACE_S), access_log=False,
            proxy_headers=False, server_header=False,
        )
        server = _make_server(config, app, settings.drain_timeout_s)
        server.run(sockets=[sock])
    finally:
        sock.close()
    return 0 if server.started else 1


MAX_DRAIN_TIMEOUT_S = 86400.0
MIN_ENGINE_STALL_TIMEOUT_S = 5.0
# after the drain timeout, the time the app has to end what still runs (error responses and events, usage records)
# before uvicorn cancels the handlers that remain
DRAIN_GRACE_S = 10.0
MAX_SPECULATIVE_TOKENS = 16  # drafts beyond this are almost never all accepted, and each costs a token of compute
# the least each count may be (the engine's own checks, made before anything starts)
_COUNTS = {"max_loras": 1, "max_lora_rank": 1, "max_cpu_loras": 1, "max_num_seqs": 1, "max_model_len": 2,
           "num_kv_blocks": 1, "tensor_parallel_size": 1}


MIN_METRICS_TOKEN_CHARS = 16


def is_loopback(host: str) -> bool:
    """Whether ``host`` (what the server binds) is reachable from this machine only."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


def warn_open_metrics(settings: Settings) -> bool:
    """A warning when ``/metrics`` (it names tenants and adapters) answers beyond this machine without a token."""
    if settings.metrics_token or is_loopback(settings.host):
        return False
    log.warning("/metrics names tenants and adapters and answers anyone who reaches %s:%d: keep it inside the "
                "cluster (the deploy/k8s ingress does) or set LORAPLEX_METRICS_TOKEN", settings.host, settings.port)
    return True


def _flag(field: str) -> str:
    """How the operator sets ``field``: its flag and its environment variable."""
    return f"--{field.replace('_', '-')} / LORAPLEX_{field.upper()}"


def check_serve_settings(settings: Settings) -> None:
    """Every value ``serve`` takes from flags or the environment, before the port is bound or anything is
    written (an engine refusing its options once started left a server that never got ready, after
    printing the bootstrap admin key). A FlagError names the flag and the limit."""
    check_int(_flag("port"), settings.port, 0, 65535, " (0: any free port)")
    for field, least in _COUNTS.items():
        check_int(_flag(field), getattr(settings, field), least)
    check_seconds(_flag("drain_timeout_s"), settings.drain_timeout_s, zero_ok=True, most=MAX_DRAIN_TIMEOUT_S)
    stall = settings.engine_stall_timeout_s
    check_seconds(_flag("engine_stall_timeout_s"), stall, zero_ok=True, most=MAX_DRAIN_TIMEOUT_S)
    if 0 < stall < MIN_ENGINE_STALL_TIMEOUT_S:
        raise FlagError(f"{_flag('engine_stall_timeout_s')} must be 0 (never) or at least "
                        f"{MIN_ENGINE_STALL_TIMEOUT_S:g} seconds (an idle engine beats once a second), got {stall:g}")
    check_int(_flag("num_speculative_tokens"), settings.num_speculative_tokens, 0, MAX_SPECULATIVE_TOKENS, " (0: off)")
    if settings.metrics_token is not None and len(settings.metrics_token) < MIN_METRICS_TOKEN_CHARS:
        raise FlagError(f"LORAPLEX_METRICS_TOKEN must be at least {MIN_METRICS_TOKEN_CHARS} characters, got "
                        f"{len(settings.metrics_token)}")
    if not (math.isfinite(settings.gil_switch_interval_ms) and 0 <= settings.gil_switch_interval_ms <= 1000):
        raise FlagError(f"LORAPLEX_GIL_SWITCH_INTERVAL_MS must be at least 0 and at most 1000, "
                        f"got {settings.gil_switch_interval_ms:g}")
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", settings.device):
        raise FlagError(f"{_flag('device')} must be auto, cpu, cuda or cuda:N, got {settings.device!r}")
    if settings.dtype not in DTYPES:
        raise FlagError(f"{_flag('dtype')} must be one of {', '.join(DTYPES)}, got {settings.dtype!r}")
    if settings.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise FlagError(f"{_flag('kv_cache_dtype')} must be one of {', '.join(KV_CACHE_DTYPES)}, got "
                        f"{settings.kv_cache_dtype!r}")
    from loraplex.platform.engine_boot import demo_model_dir, engine_config

    try:  # the engine's own checks (a CUDA device this machine has, ...), without loading anything
        engine_config(settings, Path(settings.model or demo_model_dir(settings)), "check")
    except ValueError as exc:
        message = str(exc)
        fields = ("device", "kv_cache_dtype", "lora_expand_first_min_tokens", "lora_gemm_shrink_max_tokens",
                  "lora_gemm_shrink_max_moves", "prompt_lookup_min",
                  "num_speculative_tokens", "quantization", "merge_single_lora", *_COUNTS)
        field = next((f for f in fields if message.startswith(f)), "device")
        raise FlagError(f"{_flag(field)}: {message}") from None


def _bind(settings: Settings) -> socket.socket:
    """The listening socket, bound up front so a taken port is a one-line error before any start-up work."""
    family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((settings.host, settings.port))
    except OSError as exc:
        sock.close()
        where = f"{settings.host}:{settings.port}"
        if exc.errno == errno.EADDRINUSE:
            why = "the port is already in use (another server?); pick another with --port / LORAPLEX_PORT"
        elif exc.errno == errno.EACCES:
            why = "permission denied (ports below 1024 need privileges); use --port / LORAPLEX_PORT"
        elif exc.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT) or isinstance(exc, socket.gaierror):
            why = "no such address on this machine; check --host / LORAPLEX_HOST"
        else:
            why = exc.strerror or str(exc)
        raise ConfigError(f"cannot listen on {where}: {why}") from exc
    sock.set_inheritable(True)
    return sock


def _make_server(config, app, drain_timeout_s: float):
    """A uvicorn.Server whose exit signal first marks the app as draining (``/ready`` -> 503). Requests still
    running ``drain_timeout_s`` later are ended by the app (a 503 ``draining``, or an error event in a stream,
    usage recorded as ``error``); uvicorn's own graceful timeout, which cancels handlers mid-response, is set
    :data:`DRAIN_GRACE_S` beyond it (``config.timeout_graceful_shutdown``)."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            self._loop = asyncio.get_running_loop()
            await super().startup(sockets=sockets)
            if self.started and sockets:  # uvicorn only announces sockets it bound itself
                self._log_started_message(sockets)

        def handle_exit(self, sig, frame) -> None:  # a signal handler, in the event loop's (main) thread
            services = app.state.get("services")
            if services is not None and not services.draining:
                services.draining = True
                log.info("signal %s: draining (in-flight requests finish within %g s, new ones are refused)",
                         sig, drain_timeout_s)
                loop = getattr(self, "_loop", None)
                if loop is not None:  # call_soon_threadsafe: the one loop call safe from a signal handler
                    loop.call_soon_threadsafe(loop.call_later, drain_timeout_s, _expire_drain, services)
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self):
            with super().capture_signals():
                yield
                # uvicorn re-raises the captured SIGTERM after shutdown (exit by signal); a completed
                # drain is a clean exit, so the process returns 0 instead
                self._captured_signals.clear()

    return DrainingServer(config)


def _expire_drain(services) -> None:
    if not services.drain_expired:
        services.drain_expired = True
        log.warning("drain timeout passed: requests still running end with 503 draining")
