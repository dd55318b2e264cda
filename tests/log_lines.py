"""The root logger's lines as an operator's log shipper sees them (``loraplex.log.JsonFormatter``), at every level."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator

from loraplex.log import JsonFormatter


class Lines(logging.Handler):
    def __init__(self, formatter: logging.Formatter):
        super().__init__(logging.DEBUG)
        self.setFormatter(formatter)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))

    def json(self) -> list[dict]:
        return [json.loads(line) for line in self.lines]

    def server_lines(self) -> list[str]:
        """Without the test client's own (httpx logs the URLs it requests)."""
        return [line for line in self.lines if json.loads(line)["logger"] not in ("httpx", "httpcore")]


@contextlib.contextmanager
def json_log_lines() -> Iterator[Lines]:
    handler = Lines(JsonFormatter())
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
