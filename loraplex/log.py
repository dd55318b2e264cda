"""Logging is set up once, by the CLI entry point (or a server), never at import time."""

from __future__ import annotations

import logging
import os

_configured = False


def setup_logging(level: str | None = None) -> None:
    global _configured
    if _configured:
        return
    _configured = True
    level = (level or os.environ.get("LORAPLEX_LOG_LEVEL") or "INFO").upper()
    logging.basicConfig(
        level=level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # chatty third-party loggers
    for name in ("httpx", "httpcore", "aiosqlite", "asyncio", "urllib3"):
        logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLevelName(level)))
