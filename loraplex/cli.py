"""The ``loraplex`` command: one entry point, subcommands registered by each area.

Each area module exposes ``register(subparsers)`` which adds its subcommand(s) and sets
``func`` (called with the parsed args; returns an exit code). Modules are imported lazily so
``loraplex --help`` stays fast and areas stay independent.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from loraplex import closed_pipe
from loraplex.log import setup_logging
from loraplex.settings import ConfigError, unknown_variables

# (module path) — each defines register(subparsers)
COMMAND_MODULES = (
    "loraplex.demo_cli",  # demo-model
    "loraplex.platform.cli",  # serve, admin, db, adapter, usage
    "loraplex.batch.command",  # batch
    "loraplex.bench.cli",  # bench
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loraplex", description="Multi-tenant LoRA serving")
    parser.add_argument("--data-dir", help="state directory of the embedded default (env LORAPLEX_DATA_DIR)")
    parser.add_argument("--log-level", help="DEBUG, INFO, WARNING (env LORAPLEX_LOG_LEVEL)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for path in COMMAND_MODULES:
        try:
            module = importlib.import_module(path)
        except ModuleNotFoundError as exc:
            # an area that is not built yet; any other missing import is a real error
            if exc.name and path.startswith(exc.name):
                continue
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        setup_logging(args.log_level)
        for name in unknown_variables():
            logging.getLogger("loraplex").warning("ignoring %s: not a Loraplex setting (loraplex/settings.py)", name)
        if not getattr(args, "func", None):
            parser.print_help()
            return 2
        rc = args.func(args)
        sys.stdout.flush()  # here, not at exit: a reader that has gone away (| head -1) fails inside this try
    except BrokenPipeError:
        if not closed_pipe.reader_gone():
            raise
        return closed_pipe.stop(f"loraplex {args.command}: stopped: the reader of stdout closed it")
    except ConfigError as exc:
        # something the operator can fix (a setting, a URL, a service that is down): one line, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
