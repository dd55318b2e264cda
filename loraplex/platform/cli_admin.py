"""``loraplex admin tenant create|list|suspend|activate`` and ``loraplex admin key create|list|revoke``."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from datetime import datetime, timedelta

from loraplex.platform.cli import (
    FlagError,
    add_common,
    check_int,
    check_services,
    flag_checked,
    flag_error,
    settings_from_args,
)
from loraplex.platform.db import as_utc
from loraplex.platform.models import ALL_SCOPES
from loraplex.platform.tenants import MAX_KEY_DAYS, MAX_RATE_LIMIT, TENANT_NAME_RE, TENANT_NAME_RULE


def register(subparsers) -> None:
    admin = subparsers.add_parser("admin", help="tenants and API keys (acts on the configured database)")
    groups = admin.add_subparsers(dest="admin_group", metavar="GROUP", required=True)

    tenant = groups.add_parser("tenant", help="tenants")
    t_sub = tenant.add_subparsers(dest="admin_action", metavar="ACTION", required=True)
    p = t_sub.add_parser("create", help="create a tenant")
    p.add_argument("name", help="lowercase letters, digits, '-' or '_' (at most 63)")
    p.add_argument("--requests-per-minute", type=int, help="rate limit (default: LORAPLEX_DEFAULT_REQUESTS_PER_MINUTE)")
    p.add_argument("--tokens-per-minute", type=int, help="rate limit (default: LORAPLEX_DEFAULT_TOKENS_PER_MINUTE)")
    p.set_defaults(func=_run, action_fn=_tenant_create, check=_check_tenant_create,
                   flags={"requests_per_minute": "--requests-per-minute", "tokens_per_minute": "--tokens-per-minute"})
    p = t_sub.add_parser("list", help="list tenants")
    p.set_defaults(func=_run, action_fn=_tenant_list)
    for name, fn in (("suspend", _tenant_suspend), ("activate", _tenant_activate)):
        p = t_sub.add_parser(name, help=f"{name} a tenant")
        p.add_argument("name", help="tenant name or id")
        p.set_defaults(func=_run, action_fn=fn)

    key = groups.add_parser("key", help="API keys")
    k_sub = key.add_subparsers(dest="admin_action", metavar="ACTION", required=True)
    p = k_sub.add_parser("create", help="create a key (printed once)")
    p.add_argument("--tenant", required=True, help="tenant name or id")
    p.add_argument("--scope", action="append", choices=ALL_SCOPES, dest="scopes",
                   help="repeatable; default: inference")
    p.add_argument("--name", help="a label for the key")
    p.add_argument("--expires-in-days", type=float, help=f"expire after this many days (at most {MAX_KEY_DAYS})")
    p.set_defaults(func=_run, action_fn=_key_create, check=_check_key_create,
                   flags={"tenant": "--tenant", "scopes": "--scope", "name": "--name", "expires_at": "--expires-in-days"})
    p = k_sub.add_parser("list", help="list keys (never the secrets)")
    p.add_argument("--tenant", help="only this tenant's keys")
    p.set_defaults(func=_run, action_fn=_key_list, flags={"tenant": "--tenant"})
    p = k_sub.add_parser("revoke", help="revoke a key")
    p.add_argument("key_id", help="the key id (middle part of lpx-<id>-<secret>)")
    p.set_defaults(func=_run, action_fn=_key_revoke)

    for parser in (tenant, key, *t_sub.choices.values(), *k_sub.choices.values()):
        if parser in (tenant, key):
            continue
        add_common(parser)
        parser.add_argument("--json", action="store_true", help="machine-readable output")


def _check_tenant_create(args: argparse.Namespace) -> None:
    if not TENANT_NAME_RE.match(args.name):
        raise FlagError(f"tenant name {args.name!r}: {TENANT_NAME_RULE}")
    check_int("--requests-per-minute", args.requests_per_minute, 1, MAX_RATE_LIMIT, " (or leave the flag out for "
              "the server default)")
    check_int("--tokens-per-minute", args.tokens_per_minute, 1, MAX_RATE_LIMIT, " (or leave the flag out for "
              "the server default)")


def _check_key_create(args: argparse.Namespace) -> None:
    days = args.expires_in_days
    if days is not None and not (math.isfinite(days) and 0 < days <= MAX_KEY_DAYS):
        raise FlagError(f"--expires-in-days must be more than 0 and at most {MAX_KEY_DAYS}, got {days:g}")


@flag_checked
def _run(args: argparse.Namespace) -> int:
    from loraplex.platform.errors import ApiError

    # values no run could use are refused before the database is opened (or, for a new data dir, created)
    check = getattr(args, "check", None)
    if check is not None:
        check(args)
    try:
        return asyncio.run(_with_services(args))
    except ApiError as exc:
        print(flag_error(exc, getattr(args, "flags", {})), file=sys.stderr)
        return 1


async def _with_services(args: argparse.Namespace) -> int:
    from loraplex.platform import migrate
    from loraplex.platform.db import is_sqlite, make_engine, make_session_factory
    from loraplex.platform.kv import make_kv

    settings = settings_from_args(args)
    # everything answers before anything changes (a Redis outage after the commit would leave a change
    # whose invalidation never went out); listings refuse a data dir without a database (a typo)
    new_database = await check_services(settings, must_exist=args.action_fn in (_tenant_list, _key_list))
    url = settings.effective_database_url
    if is_sqlite(url):
        # the embedded default: create/upgrade the database so the CLI works before the first serve
        await migrate.upgrade_async(url, settings=settings)
    if new_database:
        print(f"note: created a new database in {settings.data_path} (servers on another data dir will not "
              "see this change)", file=sys.stderr)
    engine = make_engine(url, settings)
    sessions = make_session_factory(engine)
    redis_url = settings.effective_redis_url
    if redis_url is None and args.action_fn in _INVALIDATING:
        redis_url = await _servers_redis(sessions, url, _INVALIDATING[args.action_fn], settings.redis_password)
    kv = make_kv(redis_url)
    try:
        async with sessions() as session:
            return await args.action_fn(args, session, kv)
    finally:
        await kv.close()
        await engine.dispose()


def _emit(args, rows: list[dict], columns: list[str], single: bool = True) -> None:
    """A table, or JSON (one object for single-item commands, else a list)."""
    if args.json:
        print(json.dumps(rows[0] if single else rows, default=str, indent=2))
        return
    widths = {c: max(len(c), *(len(str(r.get(c) or "")) for r in rows)) if rows else len(c) for c in columns}
    print("  ".join(c.upper().ljust(widths[c]) for c in columns))
    for r in rows:
        print("  ".join(str(r.get(c) if r.get(c) is not None else "-").ljust(widths[c]) for c in columns))


def _tenant_row(t) -> dict:
    return {"id": t.id, "name": t.name, "status": t.status, "created_at": as_utc(t.created_at),
            "requests_per_minute": t.requests_per_minute, "tokens_per_minute": t.tokens_per_minute}


_TENANT_COLS = ["name", "id", "status", "requests_per_minute", "tokens_per_minute", "created_at"]


async def _tenant_create(args, session, kv) -> int:
    from loraplex.platform import tenants

    t = await tenants.create_tenant(session, args.name, args.requests_per_minute, args.tokens_per_minute)
    _emit(args, [_tenant_row(t)], _TENANT_COLS)
    return 0


async def _tenant_list(args, session, kv) -> int:
    from loraplex.platform import tenants

    _emit(args, [_tenant_row(t) for t in await tenants.list_tenants(session)], _TENANT_COLS, single=False)
    return 0


async def _set_status(args, session, kv, status: str) -> int:
    from loraplex.platform import tenants

    t = await tenants.set_tenant_status(session, kv, args.name, status)
    _emit(args, [_tenant_row(t)], _TENANT_COLS)
    return 0


async def _tenant_suspend(args, session, kv) -> int:
    return await _set_status(args, session, kv, "suspended")


async def _tenant_activate(args, session, kv) -> int:
    return await _set_status(args, session, kv, "active")


def _key_row(k, tenant_name: str) -> dict:
    return {"id": k.id, "tenant": tenant_name, "scopes": ",".join(k.scopes or []), "name": k.name,
            "created_at": as_utc(k.created_at), "expires_at": as_utc(k.expires_at),
            "revoked_at": as_utc(k.revoked_at), "last_used_at": as_utc(k.last_used_at)}


_KEY_COLS = ["id", "tenant", "scopes", "name", "created_at", "expires_at", "revoked_at", "last_used_at"]


async def _key_create(args, session, kv) -> int:
    from loraplex.platform import tenants
    from loraplex.platform.db import utcnow

    expires_at: datetime | None = None
    if args.expires_in_days is not None:  # in range (``_check_key_create``)
        expires_at = utcnow() + timedelta(days=args.expires_in_days)
    key, new = await tenants.create_key(session, args.tenant, args.scopes, args.name, expires_at)
    if args.json:
        row = _key_row(key, args.tenant)
        row["key"] = new.key
        print(json.dumps(row, default=str, indent=2))
    else:
        print(new.key)
        print(f"(key id {key.id}, scopes {','.join(key.scopes)}; the key is shown once: store it now)",
              file=sys.stderr)
    return 0


async def _key_list(args, session, kv) -> int:
    from loraplex.platform import tenants

    rows = [_key_row(k, t.name) for k, t in await tenants.list_keys(session, args.tenant)]
    _emit(args, rows, _KEY_COLS, single=False)
    return 0


async def _key_revoke(args, session, kv) -> int:
    from loraplex.platform import tenants

    k = await tenants.revoke_key(session, kv, args.key_id)
    print(f"revoked {k.id}")
    return 0


# commands whose change every replica's auth cache must hear of, and how a warning names it (None: no warning;
# a re-activated tenant waiting out a cache TTL is a delay, not a hole)
_INVALIDATING = {_key_revoke: "the revocation", _tenant_suspend: "the suspension", _tenant_activate: None}


async def _servers_redis(sessions, database_url: str, change: str | None, password: str | None) -> str | None:
    """Without --redis-url: the Redis the servers recorded in the database (deployment.py), with ``password``
    (LORAPLEX_REDIS_PASSWORD) in place of the password it never records, when the CLI can reach it. Otherwise the
    change is still made (an operator revoking a leaked key must not be stopped by a Redis the CLI cannot reach) and
    a warning says how long servers on Redis keep the old state."""
    from loraplex.platform import deployment
    from loraplex.platform.auth import AUTH_CACHE_TTL_REDIS_S
    from loraplex.platform.cli import check_redis
    from loraplex.platform.db import is_sqlite
    from loraplex.settings import ConfigError, url_with_password

    recorded = await deployment.servers_redis_url(sessions)
    if recorded == "" or (recorded is None and is_sqlite(database_url)):
        return None  # the servers run without Redis: their in-process auth cache lives 0.5 s
    why = None
    if recorded is None:
        why = "the servers have recorded no Redis URL in this database (none of this version has started on it)"
    elif deployment.password_hidden(recorded) and not password:
        why = (f"the servers use Redis at {recorded}, whose password is not recorded (set LORAPLEX_REDIS_PASSWORD to "
               "it)")
    else:
        usable = url_with_password(recorded, password) if deployment.password_hidden(recorded) else recorded
        try:
            await check_redis(usable)
        except ConfigError as exc:
            why = f"the servers' Redis (recorded in the database) does not answer here: {exc}"
    if why is None:
        print(f"note: invalidating on the servers' Redis at {recorded} (recorded in the database; --redis-url "
              "overrides it)", file=sys.stderr)
        return usable
    if change is not None:
        print(f"warning: {why}. Without --redis-url, {change} reaches servers that use Redis only when their auth "
              f"cache expires, up to {AUTH_CACHE_TTL_REDIS_S:g} s from now, not within 1 s: pass --redis-url (or "
              "LORAPLEX_REDIS_URL) with the servers' Redis", file=sys.stderr)
    return None
