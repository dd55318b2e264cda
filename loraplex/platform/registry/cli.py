"""``loraplex adapter upload|list|delete``: the tenant workflow, over HTTP to a running server.

The key comes from ``--api-key`` or ``LORAPLEX_API_KEY``; the server from ``--url``, ``LORAPLEX_URL``, or
``http://<LORAPLEX_HOST>:<LORAPLEX_PORT>``.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

from loraplex.adapters.config_check import CONFIG_NAME
from loraplex.adapters.validate import WEIGHTS_NAME
from loraplex.platform.cli import FlagError, check_seconds, flag_checked
from loraplex.platform.registry.models import VISIBILITIES

ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".zip")
MAX_TIMEOUT_S = 86400.0


def register(subparsers) -> None:
    p = subparsers.add_parser("adapter", help="upload, list and delete LoRA adapters on a server")
    sub = p.add_subparsers(dest="adapter_command", metavar="ACTION", required=True)

    up = sub.add_parser("upload", help="upload a PEFT adapter directory or a .tar.gz/.zip holding one")
    up.add_argument("name", help="adapter name (a new version if it exists)")
    up.add_argument("path", help="directory with adapter_config.json + adapter_model.safetensors, or an archive")
    up.add_argument("--description")
    up.add_argument("--visibility", choices=VISIBILITIES)
    up.add_argument("--share-with", action="append", default=[], metavar="TENANT",
                    help="tenant to share with (repeatable; implies --visibility shared)")
    up.set_defaults(func=flag_checked(run), action=_upload)

    ls = sub.add_parser("list", help="adapters you own or may use")
    ls.set_defaults(func=flag_checked(run), action=_list)

    rm = sub.add_parser("delete", help="delete an adapter, or one version with NAME@N")
    rm.add_argument("name")
    rm.set_defaults(func=flag_checked(run), action=_delete)

    for parser in (up, ls, rm):
        parser.add_argument("--url", help="server URL (env LORAPLEX_URL; default http://LORAPLEX_HOST:LORAPLEX_PORT)")
        parser.add_argument("--api-key", help="API key (env LORAPLEX_API_KEY)")
        parser.add_argument("--json", action="store_true", help="print the server's JSON")
        parser.add_argument("--timeout", type=float, default=600.0,
                            help=f"seconds (default 600, at most {MAX_TIMEOUT_S:g})")


class CliError(Exception):
    pass


def _client(args):
    import httpx

    key = args.api_key or os.environ.get("LORAPLEX_API_KEY")
    if not key:
        raise CliError("no API key: pass --api-key or set LORAPLEX_API_KEY")
    return httpx.Client(base_url=_server_url(args), timeout=args.timeout, headers={"Authorization": f"Bearer {key}"})


def _server_url(args) -> str:
    from loraplex.settings import Settings

    url = args.url or os.environ.get("LORAPLEX_URL")
    if not url:
        settings = Settings.from_env()
        url = f"http://{settings.host}:{settings.port}"
    return url.rstrip("/")


def _check(response) -> dict:
    if response.status_code >= 400:
        try:
            message = response.json()["error"]["message"]
        except Exception:
            message = response.text[:500]
        raise CliError(f"HTTP {response.status_code}: {message}")
    return response.json()


def _check_flags(args) -> None:
    """Before any file is opened or the server is called: a FlagError naming the flag and the limit."""
    check_seconds("--timeout", args.timeout, zero_ok=False, most=MAX_TIMEOUT_S)
    url = args.url or os.environ.get("LORAPLEX_URL")
    if url and not url.startswith(("http://", "https://")):
        where = "--url" if args.url else "LORAPLEX_URL"
        raise FlagError(f"{where} must start with http:// or https://, got {url[:200]!r}")
    path = getattr(args, "path", None)
    if path is not None and not Path(path).exists():
        raise FlagError(f"PATH {path} does not exist (an adapter directory or a .tar.gz/.tgz/.zip archive)")


def _upload(args) -> dict:
    path = Path(args.path)
    data: dict[str, object] = {"name": args.name}
    if args.description is not None:
        data["description"] = args.description
    if args.visibility:
        data["visibility"] = args.visibility
    if args.share_with:
        data["shared_with"] = ",".join(args.share_with)
    with contextlib.ExitStack() as stack:
        if path.is_dir():
            missing = [n for n in (CONFIG_NAME, WEIGHTS_NAME) if not (path / n).is_file()]
            if missing:
                raise CliError(f"{path} has no {' or '.join(missing)} (only safetensors weights are accepted)")
            files = {
                "config": (CONFIG_NAME, stack.enter_context(open(path / CONFIG_NAME, "rb")), "application/json"),
                "weights": (WEIGHTS_NAME, stack.enter_context(open(path / WEIGHTS_NAME, "rb")),
                            "application/octet-stream"),
            }
        elif path.is_file() and path.name.lower().endswith(ARCHIVE_SUFFIXES):
            files = {"archive": (path.name, stack.enter_context(open(path, "rb")), "application/octet-stream")}
        else:
            raise CliError(f"{path} is neither an adapter directory nor a .tar.gz/.tgz/.zip archive")
        with _client(args) as client:
            return _check(client.post("/v1/adapters", data=data, files=files))


def _list(args) -> dict:
    with _client(args) as client:
        return _check(client.get("/v1/adapters"))


def _delete(args) -> dict:
    with _client(args) as client:
        return _check(client.delete(f"/v1/adapters/{args.name}"))


def _show(args, out: dict) -> None:
    if args.json:
        print(json.dumps(out, indent=2))
    elif args.adapter_command == "upload":
        v = next(x for x in out["versions"] if x["version"] == out["version"])
        print(f"uploaded {out['model']} version {out['version']}: {v['status']}, rank {v['rank']}, "
              f"{v['dtype']}, sha256 {v['sha256'][:12]}; call it with model={out['model']!r}")
    elif args.adapter_command == "list":
        rows = [("MODEL", "VERSION", "STATUS", "VISIBILITY", "OWNER")]
        rows += [(a["model"], str(a["latest_version"] or "-"), a["status"], a["visibility"], a["owner"])
                 for a in out["data"]]
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        for r in rows:
            print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    else:
        print(f"deleted {out['id']}")


def run(args) -> int:
    import httpx

    _check_flags(args)
    try:
        out = args.action(args)
    except httpx.TransportError as exc:  # no server there, or it went away
        print(f"error: cannot reach the server at {_server_url(args)}: {exc or type(exc).__name__} "
              "(pass --url or set LORAPLEX_URL)", file=sys.stderr)
        return 1
    except (CliError, OSError, httpx.HTTPError) as exc:  # server errors, unreadable files
        print(f"error: {exc}", file=sys.stderr)
        return 1
    _show(args, out)
    return 0
