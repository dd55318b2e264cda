"""Outermost ASGI wrapper: ``x-request-id`` on every response (404s included), refusal while draining, and
``HEAD`` on every ``GET`` route (RFC 9110 9.3.2: run as the ``GET``, same status, headers and auth, no body).

The request id (the client's ``X-Request-Id`` when it is a short plain token, else a new ``req-...``) and, once
known, the tenant and the completion id are on every log line written while the request runs
(:func:`loraplex.log.request_log_context`). With ``access_log_enabled``, one ``loraplex.access`` line a request: method,
path (never the query string), status, duration and those ids; never a header's value or a body."""

from __future__ import annotations

import logging
import re
import time
import uuid
from dataclasses import dataclass

import msgspec
from litestar.types import ASGIApp, Message, Receive, Scope, Send

from loraplex.log import request_log_context
from loraplex.platform.auth import KEY_ID_LEN, KEY_PREFIX
from loraplex.platform.errors import ErrorBody, ErrorResponse

access_log = logging.getLogger("loraplex.access")
_SAFE_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}\Z")
# a completion's id, the first member of its JSON body or of a stream's first event (msgspec keeps field order):
# what the usage ledger records as request_id
_COMPLETION_ID = re.compile(rb'^(?:data: ?)?\{\s*"id"\s*:\s*"((?:chat)?cmpl-[A-Za-z0-9]{1,64})"')
MAX_LOGGED_PATH_CHARS = 256
# an API key a client put in a path (a misconfigured base URL): its secret, whole or in part, is never logged
_KEY_SECRET_IN_PATH = re.compile(rf"({KEY_PREFIX}-[a-z0-9]{{{KEY_ID_LEN}}}-)[A-Za-z0-9]+")
# while draining these still answer (probes, scraping)
_ALWAYS_OPEN = ("/health", "/ready", "/metrics")
REQUEST_ID_HEADER = b"x-request-id"
_DRAINING_BODY = msgspec.json.encode(ErrorResponse(ErrorBody(
    message="Server is shutting down; retry on another replica.", type="server_error", code="draining",
)))


def request_id_of(scope: Scope) -> str:
    return scope.get("state", {}).get("request_id", "")


def _incoming_id(scope: Scope) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == REQUEST_ID_HEADER:
            text = value.decode("latin-1")
            return text if _SAFE_ID.match(text) else None
    return None


def _allow_with_head(headers: list) -> list:
    """``Allow`` lists ``HEAD`` wherever it lists ``GET`` (405s and ``OPTIONS`` answers)."""
    out = []
    for name, value in headers:
        if name.lower() == b"allow":
            methods = [m.strip() for m in value.decode("latin-1").split(",")]
            if "GET" in methods and "HEAD" not in methods:
                methods.insert(methods.index("GET") + 1, "HEAD")
                value = ", ".join(methods).encode("latin-1")
        out.append((name, value))
    return out


def _without_body(send: Send) -> Send:
    """A ``HEAD`` answer: the ``GET``'s status and headers (``content-length`` included), then an empty body
    that ends the response; the rest of a streamed body is dropped (the server then reports the client as
    gone, which stops the stream)."""
    done = False

    async def send_head(message: Message) -> None:
        nonlocal done
        if message["type"] != "http.response.body":
            await send(message)
        elif not done:
            done = True
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    return send_head


@dataclass
class _Exchange:
    """What the log lines of one request say about it."""

    request_id: str
    state: dict  # the scope's state: the principal lands there once authenticated (auth.principal_of)
    status: int | None = None
    completion_id: str | None = None
    body_seen: bool = False

    def log_fields(self) -> dict[str, str | None]:
        principal = self.state.get("principal")
        return {"request_id": self.request_id, "tenant": getattr(principal, "tenant_name", None),
                "completion_id": self.completion_id}

    def saw(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        elif message["type"] == "http.response.body" and not self.body_seen and message.get("body"):
            self.body_seen = True
            match = _COMPLETION_ID.match(message["body"])
            if match:
                self.completion_id = match.group(1).decode()


def loggable_path(path: str) -> str:
    """A request path as logs show it: an API key's secret in it redacted, at most MAX_LOGGED_PATH_CHARS, control
    characters escaped (a client's path cannot start a log line of its own)."""
    return repr(_KEY_SECRET_IN_PATH.sub(r"\1[redacted]", path)[:MAX_LOGGED_PATH_CHARS])[1:-1]


def _log_access(method: str, path: str, exchange: _Exchange, started: float) -> None:
    status = exchange.status or 500  # no response started: the server answers 500
    duration_ms = round((time.perf_counter() - started) * 1e3, 1)
    path = loggable_path(path)
    access_log.info("%s %s %d %.1fms", method, path, status, duration_ms, extra={"fields": {
        "method": method, "path": path, "status": status, "duration_ms": duration_ms}})


def platform_middleware(app: ASGIApp, *, access_log_enabled: bool = False) -> ASGIApp:
    async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        started = time.perf_counter()
        method = scope["method"]
        rid = _incoming_id(scope) or f"req-{uuid.uuid4().hex}"
        state = scope.setdefault("state", {})
        state["request_id"] = rid
        exchange = _Exchange(rid, state)
        with request_log_context(exchange.log_fields):
            try:
                await _handle(app, scope, receive, send, exchange)
            finally:
                if access_log_enabled:
                    _log_access(method, scope["path"], exchange, started)

    return middleware


async def _handle(app: ASGIApp, scope: Scope, receive: Receive, send: Send, exchange: _Exchange) -> None:
    rid = exchange.request_id
    if scope["method"] == "HEAD":
        # routed, authorised and answered as the GET; a copy, so the server still sees HEAD
        scope = {**scope, "method": "GET"}
        send = _without_body(send)

    async def send_with_id(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != REQUEST_ID_HEADER]
            headers.append((REQUEST_ID_HEADER, rid.encode()))
            message["headers"] = _allow_with_head(headers)
        exchange.saw(message)
        await send(message)

    services = scope["litestar_app"].state.get("services") if "litestar_app" in scope else None
    if services is not None and services.draining and not scope["path"].startswith(_ALWAYS_OPEN):
        body = _DRAINING_BODY
        await send_with_id({
            "type": "http.response.start", "status": 503,
            "headers": [(b"content-type", b"application/json"), (b"retry-after", b"1"),
                        (b"connection", b"close"), (b"content-length", str(len(body)).encode())],
        })
        await send_with_id({"type": "http.response.body", "body": body})
        return
    await app(scope, receive, send_with_id)
