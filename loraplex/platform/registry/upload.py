"""Receive ``POST /v1/adapters``: stream the multipart body to files in a temporary directory, under caps.

Nothing is buffered in memory beyond a parser chunk. The body is refused with 413 as soon as it (or its
``Content-Length``) passes the byte cap, and with 408 when the client stalls; the caller deletes the
temporary directory whatever happens. Text fields that arrive before the first file are handed to
``on_first_file`` so a bad name or visibility is refused before the weights are read.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from litestar import Request
from litestar.exceptions import InternalServerException
from multipart import MultipartError, ParserLimitReached, PushMultipartParser, parse_options_header

from loraplex.adapters.config_check import CONFIG_NAME
from loraplex.adapters.validate import DEFAULT_MAX_CONFIG_BYTES, PICKLE_SUFFIXES, WEIGHTS_NAME
from loraplex.platform.errors import ApiError, bad_request

TEXT_FIELDS = ("name", "description", "visibility", "shared_with")
FILE_FIELDS = {"archive": "upload.archive", "config": CONFIG_NAME, "weights": WEIGHTS_NAME}
MAX_TEXT_FIELD_BYTES = 4096
MAX_PARTS = 64


@dataclass
class UploadForm:
    fields: dict[str, str] = field(default_factory=dict)
    shared_with: list[str] = field(default_factory=list)
    files: dict[str, Path] = field(default_factory=dict)  # form field -> file in the temporary directory


def too_large(limit: int, what: str = "request body") -> ApiError:
    return ApiError(413, f"{what} is over the upload limit of {limit} bytes", param="body",
                    code="payload_too_large")


def _boundary(request: Request) -> str:
    ctype, options = parse_options_header(request.headers.get("content-type", ""))
    if ctype != "multipart/form-data" or not options.get("boundary"):
        raise ApiError(415, "Upload must be multipart/form-data with fields name, and archive or config + "
                       "weights.", param="body", code="unsupported_media_type")
    return options["boundary"]


class _Receiver:
    def __init__(self, tmp_dir: Path, max_bytes: int):
        self.tmp_dir, self.max_bytes = tmp_dir, max_bytes
        self.form = UploadForm()
        self._part = None  # current MultipartSegment
        self._text: bytearray | None = None
        self._file = None
        self._limit = 0
        self.started_files = False

    def begin(self, segment) -> None:
        name = segment.name or ""
        if segment.filename is not None and segment.filename.lower().endswith(PICKLE_SUFFIXES):
            raise ApiError(422, f"{segment.filename[:100]!r} is a pickle-format file: refused and never opened; "
                           f"upload {WEIGHTS_NAME}", param=name or "weights", code="adapter_invalid")
        self._part = segment
        if name in FILE_FIELDS:
            if name in self.form.files:
                raise bad_request(f"file field '{name}' appears twice", param=name)
            path = self.tmp_dir / FILE_FIELDS[name]
            self._file = open(path, "xb")  # noqa: SIM115 (closed in end() or close())
            self.form.files[name] = path
            self._limit = DEFAULT_MAX_CONFIG_BYTES if name == "config" else self.max_bytes
        elif name in TEXT_FIELDS:
            self._text = bytearray()
        else:
            raise bad_request(f"unknown form field '{name[:64]}' (expected: {', '.join(TEXT_FIELDS)}, "
                              f"{', '.join(FILE_FIELDS)})", param=name[:64] or "body")

    def data(self, chunk: bytes) -> None:
        name = self._part.name
        if self._file is not None:
            if self._part.bytes_received > self._limit:
                what = f"file field '{name}'"
                if name == "config":
                    raise ApiError(422, f"{what} is over the {self._limit}-byte cap for {CONFIG_NAME}",
                                   param="config", code="adapter_invalid")
                raise too_large(self._limit, what)
            self._file.write(chunk)
        else:
            assert self._text is not None
            if len(self._text) + len(chunk) > MAX_TEXT_FIELD_BYTES:
                raise bad_request(f"field '{name}' is longer than {MAX_TEXT_FIELD_BYTES} bytes", param=name)
            self._text += chunk

    def end(self) -> None:
        name = self._part.name
        if self._file is not None:
            self._file.close()
            self._file = None
        else:
            try:
                value = self._text.decode("utf-8")
            except UnicodeDecodeError:
                raise bad_request(f"field '{name}' is not UTF-8", param=name) from None
            if name == "shared_with":
                self.form.shared_with += [t.strip() for t in value.split(",") if t.strip()]
            elif name in self.form.fields:
                raise bad_request(f"field '{name}' appears twice", param=name)
            else:
                self.form.fields[name] = value
            self._text = None
        self._part = None

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def check_files(form: UploadForm) -> None:
    """One ``archive``, or ``config`` + ``weights``: decided by the form alone, before any row is created."""
    if "archive" in form.files:
        if {"config", "weights"} & set(form.files):
            raise bad_request("send either archive, or config + weights, not both", param="archive")
        return
    for name in ("config", "weights"):
        if name not in form.files:
            raise bad_request(f"missing file field '{name}' (or send one 'archive')", param=name)


class UploadSlots:
    """Uploads in progress on this replica, per tenant and in all: each holds a temporary file and a
    connection, so a flood of slow uploads is refused with 429 instead of filling the disk."""

    def __init__(self, per_tenant: int = 8, total: int = 32):
        self.per_tenant, self.total = per_tenant, total
        self._by_tenant: dict[str, int] = {}

    @contextlib.contextmanager
    def hold(self, tenant_id: str):
        if sum(self._by_tenant.values()) >= self.total or self._by_tenant.get(tenant_id, 0) >= self.per_tenant:
            raise ApiError(429, f"Too many uploads in progress (limit: {self.per_tenant} per tenant, {self.total} "
                           "per server); retry when one finishes.", type="rate_limit_error", param="body",
                           code="too_many_uploads", headers={"Retry-After": "5"})
        self._by_tenant[tenant_id] = self._by_tenant.get(tenant_id, 0) + 1
        try:
            yield
        finally:
            left = self._by_tenant[tenant_id] - 1
            if left:
                self._by_tenant[tenant_id] = left
            else:
                del self._by_tenant[tenant_id]


async def receive_upload(request: Request, tmp_dir: Path, max_bytes: int, idle_timeout_s: float,
                         on_first_file: Callable[[UploadForm], Awaitable[None]] | None = None,
                         deadline_s: float = 900.0) -> UploadForm:
    """``idle_timeout_s`` bounds a stall, ``deadline_s`` the whole body (a trickle never holds a slot forever)."""
    boundary = _boundary(request)
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise too_large(max_bytes)  # before reading a byte
    receiver = _Receiver(tmp_dir, max_bytes)
    parser = PushMultipartParser(boundary, max_header_count=8, max_segment_count=MAX_PARTS, strict=True)
    stream = request.stream().__aiter__()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + deadline_s
    total = 0
    try:
        while True:
            try:
                left = deadline - loop.time()
                if left <= 0:
                    raise asyncio.TimeoutError
                chunk = await asyncio.wait_for(stream.__anext__(), min(idle_timeout_s, left))
            except StopAsyncIteration:
                break
            except InternalServerException:  # Litestar's "client disconnected prematurely"
                raise bad_request("the client went away before the upload finished", param="body") from None
            except asyncio.TimeoutError:
                message = (f"upload took longer than {deadline_s:g} s" if loop.time() >= deadline
                           else f"upload stalled: no data for {idle_timeout_s:g} s")
                raise ApiError(408, message, param="body", code="request_timeout") from None
            total += len(chunk)
            if total > max_bytes:
                raise too_large(max_bytes)
            for event in parser.parse(chunk):
                if event is None:
                    receiver.end()
                elif isinstance(event, (bytes, bytearray)):
                    receiver.data(event)
                else:
                    if event.name in FILE_FIELDS and not receiver.started_files:
                        receiver.started_files = True
                        if on_first_file is not None:
                            await on_first_file(receiver.form)
                    receiver.begin(event)
            if not chunk:
                break
        parser.close()
    except ParserLimitReached as exc:
        raise bad_request(f"multipart body over a parser limit ({exc})", param="body") from None
    except MultipartError as exc:
        raise bad_request(f"malformed multipart body ({exc})", param="body") from None
    finally:
        receiver.close()
    return receiver.form
