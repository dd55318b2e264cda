"""INPUT and OUTPUT of a ``loraplex batch`` run: the input read once for its ids and format before anything runs
(stdin or a pipe spooled to a temporary file first), and every check of OUTPUT before anything is written to it
(--resume and --overwrite, the options file beside it, streams that are no regular file)."""

from __future__ import annotations

import codecs
import json
import logging
import os
import re
import stat
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

from loraplex.batch import openai_format, own_format, run_options

log = logging.getLogger(__name__)
_DESCRIPTOR = re.compile(r"/dev/(stdout|stderr|fd/\d+)|/proc/(self|thread-self|\d+)/fd/\d+")
LORAPLEX, OPENAI = "loraplex", "openai"  # the input formats (one a file): loraplex's own lines, OpenAI's batch lines


class BatchError(Exception):
    """A problem with the command's arguments or files: one line on stderr, exit code 2."""


# ---- input -------------------------------------------------------------------------------------------------

def stdin():
    return getattr(sys.stdin, "buffer", sys.stdin)


def stdout():
    return getattr(sys.stdout, "buffer", sys.stdout)


def open_input(args):
    """The input as bytes (a line that is not UTF-8 is that line's error) in a file that can be read twice. Stdin or
    a pipe is first copied to a temporary file: its ids are checked (check_input) before the first line runs."""
    if args.input == "-":
        src = stdin()
    else:
        try:
            src = open(args.input, "rb")  # noqa: SIM115
        except OSError as exc:
            raise BatchError(f"cannot read INPUT {args.input}: {exc.strerror}") from None
    if not is_regular_file(src):
        spooled = tempfile.TemporaryFile()  # noqa: SIM115
        for raw in src:
            spooled.write(raw.encode("utf-8", "surrogateescape") if isinstance(raw, str) else raw)
        if src is not stdin():
            src.close()
        src = spooled
        src.seek(0)
    return src


def is_regular_file(stream) -> bool:
    try:
        return stat.S_ISREG(os.fstat(stream.fileno()).st_mode)
    except (AttributeError, OSError, ValueError):  # a stream without a descriptor (a test's stdin)
        return False


class Ids:
    """Where each id of an input is, to name the ids that repeat."""

    def __init__(self):
        self.first: dict[str, int] = {}  # the id as canonical JSON -> the first line that has it
        self.repeats: dict[str, list[int]] = {}

    def add(self, rid, line_no: int) -> None:
        key = json.dumps(rid, sort_keys=True)
        if key in self.first:
            self.repeats.setdefault(key, [self.first[key]]).append(line_no)
        else:
            self.first[key] = line_no


def check_input(src, name: str) -> tuple[int, str]:
    """The input's number of lines, blank ones included (for progress), and its format: OpenAI's batch format when a
    line has a field of its envelope (``custom_id``, ``method``, ``url``, ``body``), as OpenAI's and vLLM's batch
    lines have, else loraplex's (whose lines have none of them). Refuses an input in
    which two lines have one id (OpenAI's batch API refuses a repeated custom_id): their output lines could not be
    told apart. A loraplex line without an id has its line number, which may be another line's; an OpenAI line
    without a custom_id fails on its own. Leaves ``src`` at its start."""
    ids, custom_ids = Ids(), Ids()
    numbered: set[int] = set()  # lines whose id is their line number
    openai_line = None  # the first line in OpenAI's format
    total = 0

    def counted():
        nonlocal total
        for raw in src:
            total += 1
            yield raw

    for line_no, raw in scan(counted()):
        item, _ = own_format.decode(line_no, raw)
        custom_id = openai_format.line_id(item)
        if isinstance(custom_id, str) and custom_id:
            custom_ids.add(custom_id, line_no)
        if openai_format.is_request(item):  # no loraplex id: its lines' ids are only kept for loraplex's format
            openai_line = openai_line or line_no
            continue
        if item is own_format.NOT_AN_OBJECT or "id" not in item:
            numbered.add(line_no)
        ids.add(own_format.line_id(item, line_no), line_no)
    src.seek(0)
    fmt = LORAPLEX if openai_line is None else OPENAI
    if fmt == OPENAI:
        log.info("batch: %s is in OpenAI's batch format (line %d has custom_id, method, url or body)", name,
                 openai_line)
        ids, numbered = custom_ids, set()
    if not ids.repeats:
        return total, fmt
    label = "id" if fmt == LORAPLEX else "custom_id"
    shown = []
    for key, line_nos in list(ids.repeats.items())[:5]:
        where = ", ".join(map(str, line_nos[:-1])) + f" and {line_nos[-1]}"
        without = [n for n in line_nos if n in numbered]
        shown.append(f"{label} {own_format.short(json.loads(key))} on lines {where}"
                     + (f" (line {without[0]} has no id, so its id is its line number)" if without else ""))
    more = f"; {len(ids.repeats) - len(shown)} more repeated {label}s" if len(ids.repeats) > len(shown) else ""
    raise BatchError(f"INPUT {name} repeats {label}s, so its output lines could not be matched to its lines: "
                     f"{'; '.join(shown)}{more}. Give every line its own {label}")


def scan(src) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, bytes) of each non-blank line."""
    for line_no, raw in enumerate(src, start=1):
        if isinstance(raw, str):  # a text stdin without a binary buffer
            raw = raw.encode("utf-8", "surrogateescape")
        if line_no == 1 and raw.startswith(codecs.BOM_UTF8):  # "UTF-8 with BOM" files (Windows tools)
            raw = raw[len(codecs.BOM_UTF8):]
        if raw.strip():
            yield line_no, raw


# ---- output ------------------------------------------------------------------------------------------------

@dataclass
class OutputPlan:
    """What :func:`plan_output` decided about OUTPUT, before anything is written to it."""

    stream: bool  # "-" or not a regular file: written as is, no options file, nothing to resume
    num_kept: int = 0  # complete lines an earlier run left (with --resume)
    num_kept_failed: int = 0
    options: dict | None = None


def plan_output(args, src, scanned: Iterator[tuple[int, bytes]], fmt: str, line_defaults: dict | None,
                limits: dict | None) -> OutputPlan:
    """Every check of OUTPUT, writing nothing: how many of its lines an earlier run left (their input lines are
    taken from ``scanned``, read from ``src``), and how many of those failed. ``line_defaults``, ``limits``: what the
    run records of loraplex-format lines' defaults and of an OpenAI-format run's request limits
    (run_options.of_args)."""
    path = args.output
    if os.path.isdir(path):  # not a regular file, but no stream either
        raise BatchError(f"cannot write OUTPUT {path}: it is a folder")
    if is_stream(path):  # no options file beside it, nothing to resume, nothing to overwrite
        if args.resume:
            raise BatchError(f"--resume needs OUTPUT to be a regular file, not {path}")
        if path != "-" and not os.access(path, os.W_OK):
            raise BatchError(f"cannot write OUTPUT {path}: permission denied")
        return OutputPlan(stream=True)
    # by the open input, not its name: INPUT - may be OUTPUT too (``- OUT --overwrite < OUT`` truncated its lines)
    if os.path.exists(path) and is_regular_file(src) and os.path.samestat(os.fstat(src.fileno()), os.stat(path)):
        raise BatchError(f"OUTPUT {path} is the INPUT file")
    size = os.path.getsize(path) if os.path.isfile(path) else 0
    plan = OutputPlan(stream=False, options=run_options.of_args(args, line_defaults, limits))
    if size and args.resume:
        check_options(path, plan.options)
        plan.num_kept, plan.num_kept_failed = check_resume(path, scanned, fmt)
    elif size and not args.overwrite:
        raise BatchError(f"OUTPUT {path} exists and is not empty ({size} bytes): pass --resume to continue "
                         "that run or --overwrite to replace it")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise BatchError(f"cannot write OUTPUT {path}: no such folder {folder}")
    if not os.access(path if os.path.exists(path) else folder, os.W_OK):
        raise BatchError(f"cannot write OUTPUT {path}: permission denied")
    return plan


def open_output(args, plan: OutputPlan):
    """OUTPUT opened as planned (appended to with --resume, else truncated) and, for a file, the run's options
    recorded beside it."""
    path = args.output
    if plan.stream and path == "-":
        return stdout()
    try:
        # a stream is appended to: /dev/stdout redirected to a file (``>> log``) keeps what the file held
        dst = open(path, "ab" if args.resume or plan.stream else "wb")  # noqa: SIM115
    except OSError as exc:
        raise BatchError(f"cannot write OUTPUT {path}: {exc.strerror}") from None
    if plan.stream:
        return dst
    try:
        run_options.record(path, plan.options)
    except OSError as exc:
        dst.close()
        raise BatchError(f"cannot write {run_options.path_of(path)}: {exc.strerror}") from None
    return dst


def is_stream(path: str) -> bool:
    """OUTPUT ``-``, a path naming a descriptor of the process (``/dev/stdout``, ``/dev/fd/N``: a regular file too
    where the shell redirected it to one), or a path that exists and is not a regular file (``/dev/null``, a named
    pipe): written like stdout, with no ``OUTPUT.options.json`` beside it (``/dev/null.options.json``) and no
    --resume."""
    return (path == "-" or _DESCRIPTOR.fullmatch(os.path.abspath(path)) is not None
            or (os.path.exists(path) and not os.path.isfile(path)))


def check_options(path: str, options: dict) -> None:
    """Refuse to resume with options other than those the earlier run recorded beside ``path``."""
    try:
        earlier = run_options.recorded(path)
    except ValueError as exc:
        raise BatchError(f"--resume: {run_options.path_of(path)} is not a loraplex batch options file ({exc}); "
                         "pass --overwrite to start over") from None
    if earlier is None:
        log.warning("batch --resume: %s does not exist, so the options of the earlier run cannot be compared; "
                    "continuing with this run's", run_options.path_of(path))
        return
    differing = run_options.differences(earlier, options)
    if differing:
        raise BatchError(f"--resume: {path} was generated with other options: {', '.join(differing)}; pass the "
                         "earlier run's options, or --overwrite to start over")


def check_resume(path: str, scanned: Iterator[tuple[int, bytes]], fmt: str) -> tuple[int, int]:
    """Match the output's complete lines with the input's first lines (by position, and their ids, or custom_ids in
    OpenAI's format, must agree), cut off a last line without a newline, and return how many lines are kept and how
    many of those failed."""
    label = "id" if fmt == LORAPLEX else "custom_id"
    num_kept = num_failed = end = last_line_no = 0
    with open(path, "rb") as f:
        for raw in f:
            if not raw.endswith(b"\n"):
                log.warning("batch --resume: dropping the last line of %s (%d bytes without a newline: cut "
                            "short when the earlier run was killed)", path, len(raw))
                break
            num_kept += 1
            try:
                record = json.loads(raw)
                if fmt == OPENAI:
                    out_id = record["custom_id"]
                    num_failed += openai_format.output_failed(record)
                else:
                    out_id = record["id"]
                    num_failed += "error" in record or any(o["finish_reason"] == "error" for o in record["outputs"])
            except (ValueError, TypeError, KeyError):
                shape = " in OpenAI's batch format (the input's)" if fmt == OPENAI else ""
                raise BatchError(f"--resume: line {num_kept} of {path} is not a loraplex batch output line{shape}; "
                                 "pass --overwrite to start over") from None
            line = next(scanned, None)
            if line is None:
                raise BatchError(f"--resume: {path} has more lines than the input has lines to run "
                                 f"({num_kept - 1}): it is not the output of this input")
            last_line_no = line[0]
            item = own_format.decode(*line)[0]
            in_id = openai_format.line_id(item) if fmt == OPENAI else own_format.line_id(item, line[0])
            if type(out_id) is not type(in_id) or out_id != in_id:
                raise BatchError(f"--resume: line {num_kept} of {path} has {label} {json.dumps(out_id)} but input "
                                 f"line {line[0]} has {label} {json.dumps(in_id)}: {path} is not the output of "
                                 "this input; pass --overwrite to start over")
            end += len(raw)
    if end < os.path.getsize(path):
        os.truncate(path, end)
    log.info("batch --resume: %d lines of %s kept; running the input after line %d", num_kept, path,
             last_line_no)
    return num_kept, num_failed
