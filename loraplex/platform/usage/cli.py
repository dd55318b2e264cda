"""``loraplex usage export`` (the same options as ``GET /admin/usage/export``, straight from the database)
and ``loraplex usage replay`` (move a stopped server's spooled events into the ledger)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
from pathlib import Path

from loraplex.platform.cli import add_common, check_services, flag_error, settings_from_args

# API parameter -> the flag of ``loraplex usage export`` (errors name what the operator typed)
EXPORT_FLAGS = {"from": "--from", "to": "--to", "tenant": "--tenant", "group_by": "--group-by", "format": "--format"}


def register(subparsers) -> None:
    p = subparsers.add_parser("usage", help="usage metering: billing exports, spool replay")
    sub = p.add_subparsers(dest="usage_command", metavar="ACTION", required=True)
    ex = sub.add_parser("export", help="export aggregated usage as CSV or JSON lines")
    add_common(ex)
    ex.add_argument("--from", dest="start", help="ISO date or date-time, inclusive (default: start of this month, UTC)")
    ex.add_argument("--to", dest="end", help="ISO date or date-time, exclusive (default: start of next month)")
    ex.add_argument("--tenant", help="tenant name or id (default: every tenant)")
    ex.add_argument("--group-by", "--group_by", dest="group_by", default="day", choices=("day", "adapter", "key"))
    ex.add_argument("--format", dest="fmt", default="csv", choices=("csv", "jsonl"))
    ex.add_argument("--output", "-o", help="file to write (default: stdout)")
    ex.set_defaults(func=_export)
    rp = sub.add_parser("replay", help="write spooled usage events (of stopped servers on this data dir) to the ledger")
    add_common(rp)
    rp.set_defaults(func=_replay)


async def _export_async(args: argparse.Namespace, out) -> int:
    from loraplex.platform.db import make_engine, make_session_factory
    from loraplex.platform.errors import ApiError
    from loraplex.platform.tenants import get_tenant
    from loraplex.platform.usage import aggregate, export

    settings = settings_from_args(args)
    await check_services(settings, must_exist=True, redis=False)  # exports never use Redis
    db = make_engine(settings.effective_database_url, settings)
    sessions = make_session_factory(db)
    try:
        lo, hi = aggregate.window(args.start, args.end, ("--from", "--to"))
        tenant_id = None
        if args.tenant:
            async with sessions() as s:
                tenant_id = (await get_tenant(s, args.tenant)).id
        q = aggregate.Query(lo, hi, args.group_by, tenant_id)
        # closed here, not when garbage-collected: a write that fails (stdout's reader gone) otherwise left the
        # ledger query's connection checked out past dispose(), and its cleanup ran at exit with tracebacks
        async with contextlib.aclosing(export.encode(sessions, q, args.fmt)) as chunks:
            async for chunk in chunks:
                out.write(chunk)
    except ApiError as exc:
        print(flag_error(exc, EXPORT_FLAGS), file=sys.stderr)
        return 2
    finally:
        await db.dispose()
    return 0


def _export(args: argparse.Namespace) -> int:
    if args.output:
        # written next to the target and renamed when complete: a refused or interrupted export never
        # leaves an empty or truncated billing file (nor clobbers the previous one)
        target = Path(args.output)
        partial = target.with_name(f".{target.name}.partial")
        try:
            if target.is_dir():
                raise IsADirectoryError(21, "is a directory")
            with open(partial, "wb") as f:
                code = asyncio.run(_export_async(args, f))
            if code == 0:
                os.replace(partial, target)
            return code
        except OSError as exc:
            print(f"error: --output {target}: cannot write it ({exc.strerror or exc})", file=sys.stderr)
            return 2
        finally:
            partial.unlink(missing_ok=True)
    code = asyncio.run(_export_async(args, sys.stdout.buffer))
    sys.stdout.flush()
    return code


def _replay(args: argparse.Namespace) -> int:
    from loraplex.platform.db import make_engine, make_session_factory
    from loraplex.platform.usage.routes import SPOOL_DIR
    from loraplex.platform.usage.sink import LedgerSink

    settings = settings_from_args(args)

    async def run() -> int:
        await check_services(settings, must_exist=True, redis=False)
        db = make_engine(settings.effective_database_url, settings)
        sink = LedgerSink(make_session_factory(db), settings.data_path / SPOOL_DIR)
        sink.spool.open()
        try:
            return await sink.drain_once(include_orphans=True)
        finally:
            sink.spool.close()
            await db.dispose()

    written = asyncio.run(run())
    print(f"{written} usage record(s) written to the ledger (duplicates skipped)")
    return 0
