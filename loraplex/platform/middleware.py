"""Outermost ASGI wrapper: ``x-request-id`` on every response (404s included), refusal while draining, and
``HEAD`` on every ``GET`` route (RFC 9110 9.3.2: run as the ``GET``, same status, headers and auth, no body)."""

from __future__ import annotations

import re
import uuid

import msgspec
from litestar.types import ASGIApp, Message, Receive, Scope, Send

from loraplex.platform.errors import ErrorBody, ErrorResponse

_SAFE_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
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


def platform_middleware(app: ASGIApp) -> ASGIApp:
    async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        rid = _incoming_id(scope) or f"req-{uuid.uuid4().hex}"
        scope.setdefault("state", {})["request_id"] = rid
        if scope["method"] == "HEAD":
            # routed, authorised and answered as the GET; a copy, so the server still sees HEAD
            scope = {**scope, "method": "GET"}
            send = _without_body(send)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != REQUEST_ID_HEADER]
                headers.append((REQUEST_ID_HEADER, rid.encode()))
                message["headers"] = _allow_with_head(headers)
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

    return middleware
