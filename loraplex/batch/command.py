"""``loraplex batch INPUT.jsonl OUTPUT.jsonl --model DIR``: offline generation over a JSONL file.

Input: one JSON object a line, with ``prompt`` (text) or ``prompt_token_ids``, and optionally ``id``, ``params``
(SamplingParams fields, over the command's defaults) and ``lora`` (``{"name", "id", "path"}``). Blank lines are
skipped. ``id`` comes back exactly as given (``5`` stays the number 5); a line without one (or one that is not
a JSON object) gets its 1-based line number in the input, an integer, counting every physical line, blank
ones included. Two lines with one id are refused before anything runs (their output lines could not be told
apart); stdin is read to its end first, into a temporary file.

Output: one line per non-blank input line, in input order: ``{"id", "outputs": [{"index", "text", "token_ids",
"finish_reason", "stop_reason", "error"}], "num_prompt_tokens", "num_cached_tokens"}`` (plus ``logprobs`` and
``prompt_logprobs`` where the line's params ask for them), or ``{"id", "error"}`` for a line that could not run.
Each line is written whole and flushed at once, so an interrupted run leaves only complete lines, except perhaps
a cut-short last one after a hard kill.

An input in which a line has a field of OpenAI's batch envelope (``custom_id``, ``method``, ``url``, ``body``) is read
in OpenAI's batch format instead, every line of it (openai_format.py): ``{"custom_id", "method": "POST", "url",
"body"}`` in, ``{"id", "custom_id", "response", "error"}`` out, ``custom_id`` taking the place of ``id`` (unique; no
line-number default), the body read as the server reads it, ``--served-model-name`` and ``--lora-modules`` naming
the models ``body.model`` may name. ``--max-tokens`` and ``--temperature`` are defaults of loraplex's lines only: a
body gets the server's defaults. One format a file, decided by the file and not by a flag: the two formats share no
field, so the input says which it is, and every output line of a run is of one format.

Lines run through a rolling window (window.py): up to ``--max-in-flight`` requests in the engine at once
(default 2 x max_num_seqs, so the scheduler always has the next request waiting), the next line added as soon
as one finishes; at most ``--reorder-buffer`` lines may be admitted but not yet written, which bounds memory
when an early line runs long.

An OUTPUT that exists and is not empty is refused unless ``--resume`` (keep its complete lines, drop a cut-short
last line, check that its ids are those of the input's first lines, and run only the lines after them) or
``--overwrite`` (start over). A run records the options that change what a line produces (model, dtype,
kv_cache_dtype, max_tokens, temperature, seed, ...) in ``OUTPUT.options.json`` (run_options.py); ``--resume`` with other values
is refused, naming the flags. No exception of one line ends the run (window.py). SIGINT/SIGTERM: no new lines are added, the lines in flight are aborted, the
finished lines before the oldest unfinished one are written, and the command exits with 128 + the signal
number; ``--resume`` continues from there. OUTPUT ``-`` whose reader closes the pipe (``| head``) stops the run
with one line on stderr and exit code 141 (128 + SIGPIPE). An OUTPUT that is not a regular file (``/dev/null``, a
named pipe) or names a descriptor (``/dev/stdout``) is written like ``-``: no options file beside it, no --resume.
Ctrl-C before the first line starts (reading the input, loading the model) is one line on stderr and exit code 130. Exit codes: 0 every line ran,
1 some line failed (the others ran), 2 bad arguments or an OUTPUT that cannot be used, 3 the run itself failed (an
engine step, writing OUTPUT: logged with its traceback; OUTPUT holds the lines written before, --resume continues).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import signal
import sys
import threading
import time

from loraplex import closed_pipe
from loraplex.batch import files, openai_format
from loraplex.batch.files import OPENAI, BatchError
from loraplex.batch.own_format import LoraplexFormat
from loraplex.batch.window import RollingWindow
from loraplex.engine.config import KV_CACHE_DTYPES
from loraplex.engine.sampling_params import SamplingParams, SamplingParamsError
from loraplex.platform.inference.validation import Limits
from loraplex.settings import ConfigError, Settings

log = logging.getLogger(__name__)
EXIT_LINES_FAILED, EXIT_USAGE, EXIT_RUN_FAILED = 1, 2, 3
# loraplex-format lines' defaults where --max-tokens / --temperature are not given (OpenAI bodies: the server's)
DEFAULT_MAX_TOKENS, DEFAULT_TEMPERATURE = 64, 0.0


def register(subparsers) -> None:
    p = subparsers.add_parser("batch", help="generate for every line of a JSONL file (offline)")
    p.add_argument("input", help="JSONL input (- for stdin)")
    p.add_argument("output", help="JSONL output (- for stdout)")
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--device", default="cpu")
    p.add_argument("--tokenizer", default=None,
                   help="directory of the tokenizer, when --model's directory has none (default: --model)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="KV-cache element type: auto (the model's dtype) | fp8 (float8 e4m3, half the memory per "
                        "token of bf16) | int8 (int8 with a scale per token and KV head)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help=f"default max_tokens of loraplex-format lines (default {DEFAULT_MAX_TOKENS}); OpenAI-format "
                        "bodies take the server's default")
    p.add_argument("--temperature", type=float, default=None,
                   help=f"default temperature of loraplex-format lines (default {DEFAULT_TEMPERATURE}); "
                        "OpenAI-format bodies take the server's default, 1.0")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-seqs", type=int, default=256,
                   help="sequences the engine runs at once; a line's n may not exceed it")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--enable-lora", action=argparse.BooleanOptionalAction, default=False,
                   help="accept LoRA adapters in input lines (default off)")
    p.add_argument("--served-model-name", action="extend", nargs="+", default=None, metavar="NAME",
                   help="the names OpenAI-format lines give the base model in body.model (vLLM's flag; default: "
                        "the server's, --model's directory name, and --model as given)")
    p.add_argument("--lora-modules", action="extend", nargs="+", default=None, metavar="NAME=PATH|JSON",
                   help="adapters that OpenAI-format lines name in body.model, as NAME=PATH or vLLM's JSON "
                        "'{\"name\": ..., \"path\": ..., \"base_model_name\": ...}' (needs --enable-lora)")
    p.add_argument("--max-loras", type=int, default=8)
    p.add_argument("--max-lora-rank", type=int, default=64)
    p.add_argument("--max-in-flight", type=int, default=None,
                   help="lines in the engine at once (default 2 x --max-num-seqs)")
    p.add_argument("--reorder-buffer", type=int, default=None,
                   help="most lines admitted but not yet written, while an earlier line still runs "
                        "(default 4 x --max-in-flight)")
    p.add_argument("--progress-interval", type=float, default=5.0, help="seconds between progress lines")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--resume", action="store_true",
                      help="continue an interrupted run: keep OUTPUT's complete lines, run the rest")
    mode.add_argument("--overwrite", action="store_true", help="replace an OUTPUT that is not empty")
    p.set_defaults(func=run)


def run(args) -> int:
    try:
        return _run(args)
    except BatchError as exc:
        sys.stderr.write(f"loraplex batch: error: {exc}\n")
        return EXIT_USAGE
    except KeyboardInterrupt:
        # Ctrl-C before the lines start (reading the input, loading the model): _stop_on_signals handles SIGINT
        # from the first line on, so no line has run and none was written
        sys.stderr.write("loraplex batch: interrupted before the first line ran\n")
        return 128 + signal.SIGINT
    except Exception:  # noqa: BLE001 (a defect: its own exit code, apart from lines that failed)
        log.exception("batch: the run failed")
        return EXIT_RUN_FAILED


def _run(args) -> int:
    started = time.monotonic()
    _check_args(args)
    max_in_flight = args.max_in_flight if args.max_in_flight is not None else 2 * args.max_num_seqs
    if max_in_flight < 1:
        raise BatchError(f"--max-in-flight must be at least 1, got {max_in_flight}")
    reorder = args.reorder_buffer if args.reorder_buffer is not None else 4 * max_in_flight
    if reorder < max_in_flight:
        raise BatchError(f"--reorder-buffer must be at least --max-in-flight ({max_in_flight}), got {reorder}")
    src = files.open_input(args)
    try:
        total_lines, fmt = files.check_input(src, args.input)
        scanned = files.scan(src)
        limits = _request_limits() if fmt == OPENAI else None
        line_defaults = None if fmt == OPENAI else {"max_tokens": _max_tokens(args), "temperature": _temperature(args)}
        plan = files.plan_output(args, src, scanned, fmt, line_defaults, limits)
        llm = _load(args)  # before OUTPUT is opened: a run that cannot start leaves it as it was
        dst = files.open_output(args, plan)
        try:
            line_format = _line_format(args, fmt, llm, limits)
            rc = _generate(args, llm, line_format, scanned, dst, (plan.num_kept, plan.num_kept_failed),
                           total_lines, max_in_flight, reorder, started)
        except BaseException:
            _close_output(dst, args.output)
            raise
        return _close_output(dst, args.output, rc)
    finally:
        if src is not files.stdin():
            src.close()


def _close_output(dst, where: str, rc: int = EXIT_RUN_FAILED) -> int:
    """Close OUTPUT (its last lines may still be buffered): ``rc``, or the run's failure where they cannot be
    written (a full disk)."""
    if dst is files.stdout():
        return rc
    try:
        dst.close()
    except OSError as exc:
        log.error("batch: the run failed: its last lines could not be written to %s: %s", where, exc)
        return EXIT_RUN_FAILED
    return rc


def _load(args):
    log.info("batch: loading the model from %s", args.model)
    from loraplex.engine.llm import LLM

    try:
        return LLM(args.model, tokenizer=args.tokenizer, device=args.device, dtype=args.dtype,
                   kv_cache_dtype=args.kv_cache_dtype,
                   seed=args.seed, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                   enable_lora=args.enable_lora, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank)
    except (ValueError, OSError) as exc:  # options the engine refuses, files it cannot read
        raise BatchError(f"--model {args.model}: the engine cannot start: {_ENGINE_FIELDS.sub(_flag, str(exc))}") \
            from None


def _line_format(args, fmt: str, llm, limits: dict | None):
    """How this run reads its lines and writes their records (window.LineFormat); warns of flags that do not apply
    to the input's format."""
    def refusal_text(text: str) -> str:  # the engine names its config fields, the user typed flags
        return _LIMIT_FIELDS.sub(_flag, text)

    if fmt == OPENAI:
        given = [f"--{name.replace('_', '-')}" for name in ("max_tokens", "temperature")
                 if getattr(args, name) is not None]
        if given:
            log.warning("batch: %s: defaults of loraplex-format lines only; the OpenAI-format bodies of %s take the "
                        "server's defaults (max_tokens 16 for /v1/completions, the rest of the context for chat; "
                        "temperature 1.0)", " and ".join(given), args.input)
        models = _models(args)
        ctx = openai_format.Context(
            args.seed, models, next(iter(models)), Limits(**limits, max_model_len=llm.engine.config.max_model_len),
            llm.get_tokenizer(), llm.engine.runner.model_config.vocab_size, refusal_text)
        return openai_format.OpenAIFormat(ctx)
    for flag, name in (("--lora-modules", "lora_modules"), ("--served-model-name", "served_model_name")):
        if getattr(args, name):
            log.warning("batch: %s names models for OpenAI-format lines (body.model); the lines of %s are in "
                        "loraplex's format, which names an adapter in 'lora'", flag, args.input)
    defaults = {"max_tokens": _max_tokens(args), "temperature": _temperature(args)}
    return LoraplexFormat(defaults, args.enable_lora, args.seed, refusal_text)


def _max_tokens(args) -> int:
    return DEFAULT_MAX_TOKENS if args.max_tokens is None else args.max_tokens


def _temperature(args) -> float:
    return DEFAULT_TEMPERATURE if args.temperature is None else args.temperature


def _request_limits() -> dict:
    """The server's request limits, from the settings it reads (LORAPLEX_MAX_TOKENS_LIMIT, LORAPLEX_MAX_N,
    LORAPLEX_MAX_STOP_SEQUENCES or their defaults), so a body is checked as the server would check it."""
    try:
        settings = Settings.from_env()
    except ConfigError as exc:
        raise BatchError(str(exc)) from None
    return {"max_tokens_limit": settings.max_tokens_limit, "max_n": settings.max_n,
            "max_stop_sequences": settings.max_stop_sequences}


def _generate(args, llm, line_format, scanned, dst, kept: tuple[int, int], total_lines: int | None,
              max_in_flight: int, reorder: int, started: float) -> int:
    loaded = time.monotonic()
    num_kept, num_kept_failed = kept

    def write(data: bytes) -> None:
        dst.write(data)
        dst.flush()

    streamed = files.is_stream(args.output)
    where = "stdout" if args.output == "-" else args.output
    window = RollingWindow(llm, write, line_format, max_in_flight, reorder)
    progress = _Progress(llm.engine, window.stats, args.progress_interval, total_lines, num_kept)
    with _stop_on_signals() as received:
        try:
            finished = window.run(scanned, stop=lambda: bool(received), tick=progress.tick)
        except BrokenPipeError:
            if not (streamed and closed_pipe.reader_gone(dst)):
                raise
            return closed_pipe.stop(f"loraplex batch: stopped: the reader of {where} closed it after "
                                    f"{window.stats.num_written} lines", dst)
        except Exception:  # noqa: BLE001 (the run failed, not a line: its own exit code)
            if streamed:  # nothing to resume: the lines went to a pipe or a device
                log.exception("batch: the run failed after writing %d lines to %s", window.stats.num_written, where)
            else:
                log.exception("batch: the run failed after writing %d lines (%d in all); the same command with "
                              "--resume continues after them", window.stats.num_written,
                              num_kept + window.stats.num_written)
            return EXIT_RUN_FAILED
    stats = window.stats
    wall = time.monotonic() - loaded
    log.info("batch %s: %d lines ok, %d failed%s; %d prompt tokens, %d output tokens in %.1f s (%.1f output "
             "tok/s; model load %.1f s)", "done" if finished else "stopped", stats.num_ok, stats.num_failed,
             f" (after {num_kept} lines kept from the earlier run, {num_kept_failed} of them failed)" if num_kept
             else "",
             stats.num_prompt_tokens, stats.num_output_tokens, wall, stats.num_output_tokens / max(wall, 1e-9),
             loaded - started)
    if not finished:
        signum = received[0]
        reached = f" (through input line {stats.last_line_no})" if stats.last_line_no else ""
        if streamed:
            log.warning("batch: stopped by %s after writing %d complete lines%s to %s, which is not a file: there "
                        "is nothing to --resume", signal.Signals(signum).name, stats.num_written, reached, where)
            return 128 + signum
        log.warning("batch: stopped by %s: %s holds %d complete lines%s; %d unfinished lines were dropped; run "
                    "the same command with --resume to continue", signal.Signals(signum).name, args.output,
                    num_kept + stats.num_written, reached, stats.num_dropped)
        return 128 + signum
    return 0 if stats.num_failed + num_kept_failed == 0 else EXIT_LINES_FAILED


# ---- arguments ---------------------------------------------------------------------------------------------

# engine config fields that are flags of this command: the engine's errors name the field, the user typed the flag.
# _LIMITS: those a line's refusal can name (n above max_num_seqs, a prompt over max_model_len)
_LIMITS = ("max_model_len", "max_num_seqs", "max_loras", "max_lora_rank")
_ENGINE_FIELDS = re.compile(rf"\b({'|'.join((*_LIMITS, 'dtype', 'device'))})\b")
_LIMIT_FIELDS = re.compile(rf"\b({'|'.join(_LIMITS)})\b")


def _flag(match: re.Match) -> str:
    return "--" + match.group(1).replace("_", "-")


def _check_args(args) -> None:
    """What can be checked before OUTPUT is touched and the model loaded: one error line naming the flag."""
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        what = "is not a directory" if not os.path.isdir(args.model) else "has no config.json"
        raise BatchError(f"--model {args.model} {what}: pass a Hugging Face model directory")
    if args.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise BatchError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {args.kv_cache_dtype!r}")
    if not re.fullmatch(r"cpu|cuda(:\d+)?", args.device):
        raise BatchError(f"--device must be cpu or cuda (cuda:N), got {args.device!r}")
    for flag in ("max_num_seqs", "max_loras", "max_lora_rank", "max_model_len"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise BatchError(f"--{flag.replace('_', '-')} must be at least 1, got {value}")
    try:
        SamplingParams(max_tokens=_max_tokens(args), temperature=_temperature(args))
    except SamplingParamsError as exc:
        raise BatchError(f"--{exc.param.replace('_', '-')} {exc.detail}") from None
    _models(args)


def _models(args) -> dict:
    try:
        return openai_format.models(args.model, args.served_model_name, args.lora_modules, args.enable_lora)
    except ValueError as exc:
        raise BatchError(str(exc)) from None


# ---- progress and signals ----------------------------------------------------------------------------------

class _Progress:
    """A progress line every ``interval`` seconds (checked after each engine step), never more often."""

    def __init__(self, engine, stats, interval: float, total_lines: int | None, num_kept: int):
        self.engine, self.stats, self.interval = engine, stats, interval
        self.total_lines, self.num_kept = total_lines, num_kept
        self._last = time.monotonic()
        self._last_tokens = engine.num_generated_tokens

    def tick(self) -> None:
        now = time.monotonic()
        if now - self._last < self.interval:
            return
        tokens = self.engine.num_generated_tokens
        rate = (tokens - self._last_tokens) / max(now - self._last, 1e-9)
        self._last, self._last_tokens = now, tokens
        s = self.stats
        where = f"through input line {s.last_line_no}"
        if self.total_lines:
            where += f" of {self.total_lines} ({100 * s.last_line_no / self.total_lines:.1f}%)"
        kept = f" (+{self.num_kept} kept)" if self.num_kept else ""
        log.info("batch: %d lines written%s, %s; %d failed, %d in flight, %.1f output tok/s", s.num_written,
                 kept, where, s.num_failed, s.num_in_flight, rate)


@contextlib.contextmanager
def _stop_on_signals():
    """SIGINT and SIGTERM append their number to the yielded list instead of ending the process (main thread
    only: elsewhere signal handlers cannot be set, and Ctrl-C stays a KeyboardInterrupt)."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return
    previous = {s: signal.signal(s, lambda signum, frame: received.append(signum))
                for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield received
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
