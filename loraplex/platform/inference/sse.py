"""A Litestar ``Stream`` that always runs a close callback, even when the client disconnects or the
response cannot start.

Litestar cancels a streaming body on disconnect; an async generator suspended at ``yield`` would
then not be closed until garbage collection. The callback aborts the engine request at once.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
from litestar.openapi.spec import OpenAPIMediaType, OpenAPIType, Operation, Reference, Schema
from litestar.response import Stream
from litestar.response.streaming import ASGIStreamingResponse
from litestar.utils.helpers import get_enum_string_value

SSE_MEDIA_TYPE = "text/event-stream"
DONE = b"data: [DONE]\n\n"


def sse_event(payload: msgspec.Struct | dict) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


# after a disconnect, a write to a closing transport is dropped silently (uvicorn and asyncio both just
# return); a chunk sent then would be billed but never delivered
_PARK_S = 60.0


def _connection_gone(receive) -> Callable[[], bool] | None:
    """When served by uvicorn: a check that the client's connection is closing (the transport is reached
    through the server's per-request object behind ``receive``); None for other servers."""
    cycle = getattr(receive, "__self__", None)
    transport = getattr(cycle, "transport", None)
    if transport is None or not hasattr(transport, "is_closing"):
        return None
    return lambda: transport.is_closing() or bool(getattr(cycle, "disconnected", False))


@dataclass
class StreamingOperation(Operation):
    """OpenAPI: a 200 that is JSON, or with ``stream: true`` a ``text/event-stream``."""

    def __post_init__(self) -> None:
        ok = (self.responses or {}).get("200")
        if ok is not None and not isinstance(ok, Reference) and ok.content is not None:
            # one server-sent event (schemathesis checks each event against this)
            ok.content[SSE_MEDIA_TYPE] = OpenAPIMediaType(schema=Schema(
                type=OpenAPIType.OBJECT, required=["data"],
                properties={
                    "data": Schema(type=OpenAPIType.STRING, description="a chunk (JSON), an error object "
                                   "(JSON, ends the stream) or the final `[DONE]`"),
                    "event": Schema(type=OpenAPIType.STRING),
                },
            ))


class _ClosingStreamingResponse(ASGIStreamingResponse):
    __slots__ = ("on_close",)

    async def send_body(self, send, receive) -> None:
        gone = _connection_gone(receive)

        async def send_if_connected(message) -> None:
            # usage counts a chunk once its send returns (the generator resumes); a chunk that cannot
            # reach the client must not return: park until the disconnect listener cancels the stream
            if gone is not None and gone():
                await asyncio.sleep(_PARK_S)
            await send(message)

        await super().send_body(send_if_connected, receive)

    async def __call__(self, scope, receive, send) -> None:
        # the stream owns its generation from here: the close runs however the response ends, also when
        # the headers cannot go out (an ASGI server may raise OSError on a send to a departed client)
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


class SSEStream(Stream):
    def __init__(self, content, *, on_close: Callable[[], None], headers: dict[str, str] | None = None):
        super().__init__(
            content, media_type=SSE_MEDIA_TYPE,
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})},
        )
        self.on_close = on_close

    def to_asgi_response(self, app, request, *, background=None, cookies=None, encoded_headers=None, headers=None,
                         is_head_response=False, media_type=None, status_code=None, type_encoders=None):
        headers = {**headers, **self.headers} if headers is not None else self.headers
        cookies = self.cookies if cookies is None else itertools.chain(self.cookies, cookies)
        response = _ClosingStreamingResponse(
            background=self.background or background, content_length=0, cookies=cookies,
            encoded_headers=encoded_headers, encoding=self.encoding, headers=headers,
            is_head_response=is_head_response, iterator=self.iterator,
            media_type=get_enum_string_value(media_type or self.media_type), status_code=self.status_code or status_code,
        )
        response.on_close = self.on_close
        return response
