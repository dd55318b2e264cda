"""Logging is set up once, by the CLI entry point (or a server), never at import time.

Two formats (``LORAPLEX_LOG_FORMAT``, ``loraplex serve --log-format``): ``text``, one line a record, and ``json``,
one JSON object a line (``ts``, ``level``, ``logger``, ``message``, ``exception`` when there is one). Both add the
fields of the request being handled (``request_id``, ``tenant``, ...: :func:`request_log_context`) to every line
logged while it runs, tasks it starts included.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from datetime import datetime, timezone

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# the fields of the request this task (or the task that started it) handles; a function, so what becomes known
# later (the tenant, once authenticated) is read when a line is logged
_request_fields: ContextVar[Callable[[], dict[str, str | None]] | None] = ContextVar("loraplex_request_fields",
                                                                                    default=None)
_handler: logging.Handler | None = None


@contextlib.contextmanager
def request_log_context(fields: Callable[[], dict[str, str | None]]) -> Iterator[None]:
    """Every line logged inside carries ``fields()`` (those not None)."""
    token = _request_fields.set(fields)
    try:
        yield
    finally:
        _request_fields.reset(token)


def request_fields() -> dict[str, str]:
    fields = _request_fields.get()
    return {k: v for k, v in fields().items() if v is not None} if fields else {}


class TextFormatter(logging.Formatter):
    """``TIME LEVEL LOGGER: MESSAGE request_id=... tenant=...`` (a traceback follows on its own lines); a child
    process's lines name it: ``TIME LEVEL LOGGER [engine]: MESSAGE``."""

    def __init__(self, process: str | None = None) -> None:
        super().__init__(TEXT_FORMAT if process is None else TEXT_FORMAT.replace(": ", f" [{process}]: ", 1))

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(record)
        return line + "".join(f" {k}={v}" for k, v in request_fields().items())


class JsonFormatter(logging.Formatter):
    """One JSON object a line. A record's ``extra={"fields": {...}}`` adds those keys (the access log's method,
    path, status...); the request's fields and the standard keys take precedence over them. A child process's lines
    carry ``"process": "engine"``."""

    def __init__(self, process: str | None = None) -> None:
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "ts": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds")
            .replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if self.process is not None:
            out["process"] = self.process
        out.update(request_fields())
        extra = getattr(record, "fields", None)
        if isinstance(extra, dict):
            out.update({k: v for k, v in extra.items() if k not in out})
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exception"] = record.exc_text
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, default=str, ensure_ascii=False)


def make_formatter(log_format: str, process: str | None = None) -> logging.Formatter:
    check_log_format(log_format)
    return JsonFormatter(process) if log_format == "json" else TextFormatter(process)


def current_log_format() -> str:
    """The format :func:`setup_logging` (or :func:`set_log_format`) chose; ``text`` before either ran."""
    return "json" if _handler is not None and isinstance(_handler.formatter, JsonFormatter) else "text"


def setup_child_logging(level: int, log_format: str, process: str) -> None:
    """A child process's logging (the engine's): its parent's level and format, each line naming the process."""
    handler = logging.StreamHandler()
    handler.setFormatter(make_formatter(log_format, process))
    logging.basicConfig(level=level, handlers=[handler], force=True)


def check_log_format(log_format: str) -> None:
    if log_format not in LOG_FORMATS:
        from loraplex.settings import ConfigError

        raise ConfigError(f"log format {log_format!r} is not one of {', '.join(LOG_FORMATS)} "
                          "(--log-format / LORAPLEX_LOG_FORMAT)")


def setup_logging(level: str | None = None, log_format: str | None = None) -> None:
    global _handler
    if _handler is not None:
        return
    level = (level or os.environ.get("LORAPLEX_LOG_LEVEL") or "INFO").upper()
    if not isinstance(logging.getLevelName(level), int):
        from loraplex.settings import ConfigError

        raise ConfigError(f"log level {level!r} is not one of DEBUG, INFO, WARNING, ERROR, CRITICAL "
                          "(--log-level / LORAPLEX_LOG_LEVEL)")
    formatter = make_formatter(log_format or os.environ.get("LORAPLEX_LOG_FORMAT") or "text")
    _handler = logging.StreamHandler()
    _handler.setFormatter(formatter)
    logging.basicConfig(level=level, handlers=[_handler])
    # chatty third-party loggers
    for name in ("httpx", "httpcore", "aiosqlite", "asyncio", "urllib3"):
        logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLevelName(level)))


def set_log_format(log_format: str) -> None:
    """Switch the format :func:`setup_logging` chose (``loraplex serve --log-format``, parsed after it ran)."""
    formatter = make_formatter(log_format)
    if _handler is not None:
        _handler.setFormatter(formatter)
