"""``/console/api/<path>``: the browser's way to the platform's own HTTP API.

The session cookie is HttpOnly, so page scripts never hold the API key. Script calls (adapter upload
with a progress bar, the playground's streamed completion, usage exports) go to
``/console/api/v1/...``; this handler checks the session and the CSRF header, then re-enters the app
for ``/v1/...`` with the session's key as the bearer token. The request is handled by the very route
a client with that key would reach (same validation, limits, metering, errors, streaming); the console
adds no powers of its own.
"""

from __future__ import annotations

import logging

import msgspec
from litestar import asgi
from litestar.types import Receive, Scope, Send

from loraplex.platform.console.session import (
    COOKIE,
    CSRF_HEADER,
    LoginRequired,
    SessionStore,
    tokens_equal,
)
from loraplex.platform.errors import ApiError, ErrorBody, ErrorResponse

log = logging.getLogger(__name__)

MOUNT = "/console/api"
ALLOWED_PREFIXES = ("/v1/", "/admin/")
_SAFE_METHODS = ("GET", "HEAD", "OPTIONS")
_DROP_HEADERS = {b"cookie", b"authorization", b"x-api-key", CSRF_HEADER.encode()}
_SCOPE_KEYS = ("type", "asgi", "http_version", "method", "scheme", "query_string", "client", "server", "extensions")


def _cookie(scope: Scope, name: str) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == b"cookie":
            for part in value.decode("latin-1").split(";"):
                k, _, v = part.strip().partition("=")
                if k == name:
                    return v
    return None


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None


async def _error(send: Send, status: int, message: str, code: str, type_: str = "invalid_request_error") -> None:
    body = msgspec.json.encode(ErrorResponse(ErrorBody(message=message, type=type_, code=code)))
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"cache-control", b"no-store")]})
    await send({"type": "http.response.body", "body": body})


def target_path(scope: Scope) -> str | None:
    """The platform path this call is for, or None when it is not one the console may reach."""
    raw = scope.get("raw_path") or scope["path"].encode()
    full = raw.decode("latin-1").split("?", 1)[0]
    if not full.startswith(MOUNT + "/"):
        return None
    path = full[len(MOUNT):]
    if "//" in path or "/." in path or "\\" in path or not path.startswith(ALLOWED_PREFIXES):
        return None
    return path


@asgi("/api", is_mount=True, include_in_schema=False)
async def api_proxy(scope: Scope, receive: Receive, send: Send) -> None:
    app = scope["app"]
    path = target_path(scope)
    if path is None:
        await _error(send, 404, "The console API only forwards /v1/... and /admin/... calls.", "not_found")
        return
    try:
        session = await SessionStore(app.state.services).load(_cookie(scope, COOKIE))
    except LoginRequired as exc:
        await _error(send, 401, exc.reason or "Sign in to the console first.", "not_signed_in")
        return
    except ApiError as exc:  # the session store is down
        await _error(send, exc.status_code, exc.message, exc.code or "error", exc.type)
        return
    if scope["method"] not in _SAFE_METHODS and not tokens_equal(_header(scope, CSRF_HEADER.encode()), session.csrf):
        await _error(send, 403, "Missing or wrong CSRF token; reload the page and try again.", "csrf_failed",
                     "permission_error")
        return
    inner = {k: scope[k] for k in _SCOPE_KEYS if k in scope}
    inner.update(
        path=path, raw_path=path.encode(), root_path="", state={},
        headers=[(k, v) for k, v in scope["headers"] if k not in _DROP_HEADERS]
        + [(b"authorization", f"Bearer {session.raw_key}".encode())],
    )
    await app(inner, receive, send)


def handlers() -> list:
    return [api_proxy]
