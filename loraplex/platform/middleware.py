"""Outermost ASGI wrapper: ``x-request-id`` on every response (404s included), refusal while draining."""

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


def platform_middleware(app: ASGIApp) -> ASGIApp:
    async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        rid = _incoming_id(scope) or f"req-{uuid.uuid4().hex}"
        scope.setdefault("state", {})["request_id"] = rid

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != REQUEST_ID_HEADER]
                headers.append((REQUEST_ID_HEADER, rid.encode()))
                message["headers"] = headers
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
