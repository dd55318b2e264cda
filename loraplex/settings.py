"""One settings object for every command and component.

Values come from environment variables prefixed ``LORAPLEX_`` (e.g. ``LORAPLEX_DATA_DIR``,
``LORAPLEX_DATABASE_URL``); CLI flags override them through :func:`Settings.with_overrides`.
The embedded default keeps all state under ``data_dir``.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, get_type_hints
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

ENV_PREFIX = "LORAPLEX_"


class ConfigError(ValueError):
    """A setting or environment the operator can fix (bad value, unreachable service, wrong directory).

    The ``loraplex`` command prints it as one line and exits 1, without a traceback.
    """


def _default_data_dir() -> str:
    return str(Path(os.path.expanduser("~")) / ".loraplex")


@dataclass(frozen=True)
class Settings:
    # where the embedded default keeps its SQLite database, adapter store and demo model
    data_dir: str = field(default_factory=_default_data_dir)
    # HTTP
    host: str = "127.0.0.1"
    port: int = 8000
    # storage; None = embedded default (SQLite file in data_dir / in-process cache, limiter, bus)
    database_url: str | None = None
    redis_url: str | None = None
    # the password of Redis when it is not in redis_url (a URL kept in a ConfigMap, the password in a Secret); the CLI
    # also puts it into the Redis URL the servers recorded in the database, which never holds one (deployment.py)
    redis_password: str | None = None
    # PostgreSQL (asyncpg): seconds to open a connection (asyncpg's own default is 60 s, so a database that accepts
    # and never answers held every request that needed a new connection for a minute), to wait for a free pooled
    # connection, and for one statement (0: no limit; it also bounds the pool's ping of a connection that went
    # silent). Past any of them the request is a 503 database_unavailable; SQLite ignores them
    database_connect_timeout_s: float = 5.0
    database_pool_timeout_s: float = 10.0
    database_command_timeout_s: float = 60.0
    # model + engine
    model: str | None = None  # HF directory; None = demo model generated in data_dir
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"
    enable_lora: bool = True
    max_loras: int = 8
    max_lora_rank: int = 64
    max_cpu_loras: int = 64
    lora_load_workers: int | None = None  # threads reading and validating adapter files; None: min(4, CPUs)
    merge_single_lora: bool = False  # fold a lone adapter into the weights (engine option; costs a weight copy)
    loop_torch_threads: int | None = None  # torch intra-op threads of the engine loop thread; 0: torch's default;
    # unset: 1 on the CPU, torch's default on CUDA (EngineConfig.loop_torch_threads)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    # prefill batching (engine option): while sequences decode, new prompts wait until this many prompt tokens wait
    # or the oldest has been held prefill_batch_max_wait_steps steps; 0 = off. On for the server: on the H200
    # (Poisson arrivals, docs/benchmarks/H200-2026-12-02-run10.md) 1024 cut TPOT p50 by 15-35% in 3 of 3 same-call
    # pairs; the offline LLM keeps it off (its requests arrive together)
    prefill_batch_min_tokens: int = 1024
    prefill_batch_max_wait_steps: int = 8
    prefill_batch_min_running: int = 32  # ... and only while at least this many sequences run
    # the server process's GIL switch interval (sys.setswitchinterval), ms; 0 keeps Python's (5 ms). The engine
    # loop thread shares the GIL with the HTTP event loop: each time it gives the GIL up (waiting for the GPU) it
    # may wait a whole interval to get it back while the event loop streams tokens
    gil_switch_interval_ms: float = 0.0
    # loraplex serve: run the engine's step loop in a child process of its own (ProcessEngine) instead of a thread
    # of the server (AsyncEngine), so the HTTP event loop and the engine never wait on one GIL
    engine_process: bool = True
    # loraplex serve: once the engine has loaded, freeze the heap alive then out of the cyclic GC's reach
    # (loraplex/engine/gc_heap.py; a full collection then walks ~50k objects instead of ~400k+)
    freeze_gc: bool = True
    attention_decode_split: bool = True  # engine option (EngineConfig.attention_decode_split); off for A/B runs
    piecewise_cuda_graphs: bool = True  # engine option (EngineConfig.piecewise_cuda_graphs); off for A/B runs
    lora_expand_first_min_tokens: int = 128  # engine option (EngineConfig.lora_expand_first_min_tokens); 0: never
    lora_segment_tiles: bool = False  # engine option (EngineConfig.lora_segment_tiles); measured no gain on an H200
    lora_gemm_shrink: bool = False  # engine option (EngineConfig.lora_gemm_shrink): small decode steps, slots mostly used
    lora_gemm_shrink_max_tokens: int = 64  # engine option (EngineConfig.lora_gemm_shrink_max_tokens)
    lora_gemm_shrink_max_moves: int = 8  # engine option (EngineConfig.lora_gemm_shrink_max_moves)
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_dtype: str = "auto"  # auto (the model's dtype) | fp8 | int8 (EngineConfig.kv_cache_dtype)
    quantization: str | None = None  # base weights: None (as stored) | int8 | fp8 (weight-only; EngineConfig.quantization)
    # speculative decoding with prompt-lookup drafts (EngineConfig.num_speculative_tokens; 0 = off)
    num_speculative_tokens: int = 0
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    num_kv_blocks: int | None = None  # None = sized from free memory
    tensor_parallel_size: int = 1  # ranks the model is split over (EngineConfig.tensor_parallel_size; one GPU each)
    gpu_memory_utilization: float = 0.85
    # platform limits
    max_concurrent_requests: int = 512  # global admission cap -> 503
    max_tokens_limit: int = 4096
    max_n: int = 16
    max_stop_sequences: int = 8
    max_upload_bytes: int = 512 * 1024 * 1024
    default_requests_per_minute: int = 600
    default_tokens_per_minute: int = 200_000
    drain_timeout_s: float = 30.0
    engine_restart_delay_s: float = 2.0  # first wait before a dead engine is replaced (then doubles)
    # an engine process that sends nothing for this long (an idle one beats every second, a busy one after each
    # step) is stuck: it is killed and replaced; /ready is 503 engine_stalled after a quarter of it. 0: never
    engine_stall_timeout_s: float = 60.0
    # secrets: server secret for cache-salt HMAC and session cookies; generated into data_dir if unset
    server_secret: str | None = None
    # /metrics names tenants and adapters: when set, a scrape must send ``Authorization: Bearer <token>`` (for
    # deployments where /metrics is reachable from outside; the k8s ingress keeps it inside the cluster instead)
    metrics_token: str | None = None
    log_level: str = "INFO"
    log_format: str = "text"  # text | json: one JSON object a line (loraplex/log.py)
    access_log: bool = False  # loraplex serve: one loraplex.access line a request (method, path, status, ids)
    log_prompts: bool = False

    @property
    def data_path(self) -> Path:
        return Path(self.data_dir)

    @property
    def effective_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite+aiosqlite:///{self.data_path / 'loraplex.db'}"

    @property
    def effective_redis_url(self) -> str | None:
        """``redis_url`` with ``redis_password`` in it (None: no Redis). A ConfigError when both hold a password."""
        if not self.redis_url or not self.redis_password:
            return self.redis_url
        if url_password(self.redis_url) not in (None, HIDDEN_PASSWORD):
            raise ConfigError(f"{ENV_PREFIX}REDIS_URL holds a password and {ENV_PREFIX}REDIS_PASSWORD another: set the "
                              "password in one of them")
        return url_with_password(self.redis_url, self.redis_password)

    @property
    def embedded(self) -> bool:
        return self.database_url is None and self.redis_url is None

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **overrides: Any) -> Settings:
        env = os.environ if environ is None else environ
        hints = get_type_hints(cls)
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = env.get(ENV_PREFIX + f.name.upper())
            if raw is not None:
                values[f.name] = _coerce(f.name, raw, hints[f.name])
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def with_overrides(self, **overrides: Any) -> Settings:
        return dataclasses.replace(self, **{k: v for k, v in overrides.items() if v is not None})

    def check_secrets(self) -> None:
        """A ConfigError when a secret setting still holds a placeholder of the deploy files (the server refuses to
        start on one: cache salts and console sessions keyed on a string anyone can read in this repository)."""
        found = [(ENV_PREFIX + name.upper(), m.group(0)) for name in SECRET_SETTINGS
                 if (m := _PLACEHOLDER.search(getattr(self, name) or ""))]
        if found:
            named = ", ".join(f"{variable} (it contains {word!r})" for variable, word in found)
            raise ConfigError(f"{named}: a placeholder, not a secret; set a random value (e.g. openssl rand -hex 32; "
                              "for a URL, the service's real password) in the deployment's secret (deploy/README.md)")


# settings that hold secrets (a URL: its password); one that contains what our deploy files write for a value to fill
# in (deploy/k8s/secret.example.yaml's CHANGE_ME..., a "change-me-..." string) is refused by check_secrets
SECRET_SETTINGS = ("server_secret", "metrics_token", "database_url", "redis_url", "redis_password")
_PLACEHOLDER = re.compile(r"change[-_]?me", re.IGNORECASE)


HIDDEN_PASSWORD = "***"  # stands for a password in a URL recorded or shown without it


def names_a_password(query_arg: str) -> bool:
    """Whether a URL query argument holds a secret to hide (``password=``, ``ssl_password=``, ``sslpassword=``...)."""
    return "password" in query_arg.lower()


def hide_passwords(url: str) -> str:
    """``url`` with every password in it shown as ``***``: the user part's, and any query argument named like one
    (``password=``, which redis-py, asyncpg and libpq read, ``sslpassword=``, ``ssl_password=``: a TLS key's). For
    messages and for what is recorded where others read it. Everything after ``?`` is the query (a ``#`` in a password
    does not start a fragment that would be kept); a URL that does not parse is not shown at all."""
    try:
        parts = urlsplit(url, allow_fragments=False)
        password = parts.password
    except ValueError:
        return "<a service URL that does not parse>"
    netloc = parts.netloc
    if password is not None:
        userinfo, _, host = netloc.rpartition("@")
        netloc = f"{userinfo.partition(':')[0]}:{HIDDEN_PASSWORD}@{host}"
    query = [(k, HIDDEN_PASSWORD if names_a_password(k) else v)
             for k, v in parse_qsl(parts.query, keep_blank_values=True)]
    return urlunsplit(parts._replace(netloc=netloc, query=urlencode(query, safe="*")))


def url_password(url: str) -> str | None:
    """The password in a service URL (its user part, or a ``password=`` query argument), as written; None: none."""
    parts = urlsplit(url)
    if parts.password is not None:
        return parts.password
    return dict(parse_qsl(parts.query, keep_blank_values=True)).get("password")


def url_with_password(url: str, password: str) -> str:
    """``url`` with ``password`` in place of its hidden one (``***``), or added when it has none (in the user part,
    or as a ``password=`` query argument where the URL has no host: a unix socket)."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    if any(k == "password" for k, _ in query) or not parts.hostname:
        query = [(k, password if k == "password" else v) for k, v in query] if any(
            k == "password" for k, _ in query) else [*query, ("password", password)]
        return f"{url.partition('?')[0]}?{urlencode(query)}"  # (urlunsplit drops unix:///'s empty host)
    userinfo, _, host = parts.netloc.rpartition("@")
    user = userinfo.partition(":")[0]
    return urlunsplit(parts._replace(netloc=f"{user}:{quote(password, safe='')}@{host}"))


# LORAPLEX_* variables read outside Settings: the adapter CLI (server, key), the engine's CUDA switches
# (docs/engine.md), scripts/dev and the tests; LORAPLEX_KEY is the console's example shell variable
OTHER_VARIABLES = frozenset({
    "LORAPLEX_URL", "LORAPLEX_API_KEY", "LORAPLEX_KEY", "LORAPLEX_ASYNC_SCHEDULING", "LORAPLEX_FUSED_OPS",
    "LORAPLEX_FAST_LAUNCH", "LORAPLEX_LORA_PDL", "LORAPLEX_LORA_WEIGHT_PREFETCH",
    "LORAPLEX_VENV", "LORAPLEX_TORCH_INDEX", "LORAPLEX_SCREENSHOT_DIR", "LORAPLEX_TEST_DATABASE_URL",
    "LORAPLEX_TEST_REDIS_URL", "LORAPLEX_TEST_SCHEMATHESIS_EXAMPLES",
})


def unknown_variables(environ: dict[str, str] | None = None) -> list[str]:
    """``LORAPLEX_*`` variables nothing reads, each with the nearest setting when one is close (a typo in a
    deployment's environment is otherwise silently ignored)."""
    import difflib

    env = os.environ if environ is None else environ
    known = {ENV_PREFIX + f.name.upper() for f in fields(Settings)}
    out = []
    for name in sorted(env):
        if name.startswith(ENV_PREFIX) and name not in known and name not in OTHER_VARIABLES:
            close = difflib.get_close_matches(name, sorted(known), n=1)
            out.append(f"{name} (did you mean {close[0]}?)" if close else name)
    return out


def _coerce(name: str, raw: str, hint: Any) -> Any:
    text = str(hint)
    kind = "boolean (true/false, 1/0, yes/no, on/off)" if "bool" in text else (
        "integer" if "int" in text else "number")
    try:
        if "bool" in text:
            low = raw.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if "int" in text:
            return None if raw == "" and "None" in text else int(raw)
        if "float" in text:
            return float(raw)
    except ValueError as exc:
        raise ConfigError(f"{ENV_PREFIX}{name.upper()}={raw!r} is not a valid {kind}") from exc
    return raw if raw != "" or "None" not in text else None
