"""Logging is set up once, by the CLI entry point (or a server), never at import time."""

from __future__ import annotations

import logging
import os

_configured = False


def setup_logging(level: str | None = None) -> None:
    global _configured
    if _configured:
        return
    level = (level or os.environ.get("LORAPLEX_LOG_LEVEL") or "INFO").upper()
    if not isinstance(logging.getLevelName(level), int):
        from loraplex.settings import ConfigError

        raise ConfigError(f"log level {level!r} is not one of DEBUG, INFO, WARNING, ERROR, CRITICAL "
                          "(--log-level / LORAPLEX_LOG_LEVEL)")
    _configured = True
    logging.basicConfig(
        level=level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # chatty third-party loggers
    for name in ("httpx", "httpcore", "aiosqlite", "asyncio", "urllib3"):
        logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLevelName(level)))
