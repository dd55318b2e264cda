"""JSON request bodies: typed strictly, a number no 64-bit float can hold (``1e309``) is a 400 naming its
field, and objects or arrays nested too deeply to parse are a 400 (msgspec's decoder recurses, so a body of
a few kilobytes of ``[[[[...`` would otherwise end in a RecursionError: a 500 logged as a server fault).

Litestar parses a body into plain values (``Request.json``), then converts every argument of the handler
(path, query, headers and the body's ``data``) in one lax ``msgspec.convert(..., strict=False)`` (its
signature model; no setting changes that, and a DTO decodes laxly too), because query strings and headers
are text. Lax, ``"max_tokens": "5"`` becomes 5 and ``"stream": "false"`` becomes False, where OpenAI's API
answers 400. So :meth:`JsonBodyRequest.json` converts the body to the handler's ``data`` type itself, with
``strict=True`` (JSON's own types: an integer is also a number, a boolean is no integer, and ``5.0`` is a
decimal number, not an integer, as OpenAI has it); the signature model then passes that instance through
unchanged (msgspec returns an instance of the target type as it is), and queries and headers stay lax.

Because the body is parsed without a type, msgspec's "Number out of range" comes without a field
(``$[...]``). Only on that error is the body parsed again, with Python's parser (which turns such a number
into ``inf`` instead of failing), to find the field.
"""

from __future__ import annotations

import json
import math
import re
import sys
from typing import Any

import msgspec
from litestar import Request
from litestar.exceptions import SerializationException, ValidationException

from loraplex.platform.errors import (
    TYPE_MISMATCH,
    ApiError,
    bad_request,
    validation_message,
    validation_param,
)

_OUT_OF_RANGE = "Number out of range"
# msgspec's location of an error: "... - at `$.messages[1].content`"; a dict's value is "[...]" (no key)
_AT = re.compile(r"(.*) - at `\$(.*)`", re.DOTALL)
_SEGMENT = re.compile(r"\.([^.\[]+)|\[(\d+|\.\.\.)\]")


class _Overflow:
    """A number the JSON text holds that no float can (parsed as a marker, never as ``inf``)."""


def _parse_float(text: str) -> Any:
    value = float(text)
    return _Overflow() if math.isinf(value) else value


def _first_overflow(value: Any, path: str) -> str | None:
    if isinstance(value, _Overflow):
        return path
    if isinstance(value, dict):
        items = ((f"{path}.{k}" if path else str(k), v) for k, v in value.items())
    elif isinstance(value, list):
        items = ((f"{path}[{i}]", v) for i, v in enumerate(value))
    else:
        return None
    for child_path, child in items:
        found = _first_overflow(child, child_path)
        if found is not None:
            return found
    return None


def out_of_range_field(body: bytes) -> str | None:
    """The field (``temperature``, ``logit_bias.7``, ``messages[1].content[0].x``) of the first number in
    ``body`` that overflows a float; None if there is none or the body cannot be parsed."""
    try:
        path = _first_overflow(json.loads(body, parse_float=_parse_float), "")
    except (ValueError, RecursionError):  # not JSON after all, an integer of over 4300 digits, or nested too deep
        return None
    return path or None


def _json_kind(value: Any) -> str:
    """msgspec's name for the JSON type of a parsed value (as in its "got `str`")."""
    if value is None:
        return "null"
    for cls, name in ((bool, "bool"), (int, "int"), (float, "float"), (str, "str"), (list, "array")):
        if isinstance(value, cls):  # bool before int: a boolean is an int to Python, never to JSON
            return name
    return "object"


def _field_path(location: str, body: Any, got: str | None) -> str:
    """msgspec's location of an error in ``body`` (``.messages[1].content``, ``.logit_bias[...]``) as the
    field's name (``messages[1].content``, ``logit_bias.9``: a dict's key after a dot, as elsewhere).

    msgspec leaves out which key of a dict holds the bad value. For a value of the wrong type (``got``),
    it is the first entry of that JSON type (strict typing looks at the type alone, and msgspec stops at the
    first bad entry); otherwise the dict itself is named."""
    path, value = "", body
    segments = _SEGMENT.findall(location)
    for i, (name, index) in enumerate(segments):
        if name:
            path += f".{name}" if path else name
            value = value.get(name) if isinstance(value, dict) else None
        elif index != "...":
            path += f"[{index}]"
            value = value[int(index)] if isinstance(value, list) and int(index) < len(value) else None
        else:  # a dict's value
            if i < len(segments) - 1 or got is None or not isinstance(value, dict):
                break
            key = next((k for k, v in value.items() if _json_kind(v) == got), None)
            if key is None:
                break
            path += f".{key}"
    return path


def validation_detail(error: str, body: Any) -> dict[str, str]:
    """msgspec's error converting ``body`` as a detail in the shape Litestar gives its own validation errors
    (``message``, ``source``, and the field as ``key``), which errors.py words."""
    at = _AT.fullmatch(error)
    message, location = (at.group(1), at.group(2)) if at else (error, "")
    mismatch = TYPE_MISMATCH.fullmatch(message)
    detail: dict[str, str] = {"message": message, "source": "body"}
    path = _field_path(location, body, mismatch.group(2) if mismatch else None)
    if path:
        detail["key"] = path
    return detail


def convert_body(body: Any, body_type: type, method: str, path: str) -> Any:
    """``body`` (plain JSON values) as ``body_type``, typed strictly, or the 400 the server answers a request to
    ``method path`` with that body (what a route's body gets, for a caller without HTTP: loraplex batch)."""
    try:
        return msgspec.convert(body, body_type, strict=True, str_keys=True)
    except msgspec.ValidationError as exc:
        extra = [validation_detail(str(exc), body)]
        message, code = validation_message(f"Validation failed for {method} {path}", extra)
        raise ApiError(400, message, param=validation_param(extra), code=code) from None


_NUMBER_LIMIT = "a JSON number must be finite and within about ±1.8e308 (a 64-bit float)"


def out_of_range(field: str | None) -> ApiError:
    """A number no 64-bit float holds (``1e309``), at ``field`` (None: where could not be told)."""
    if field is None:
        return bad_request(f"A number in the request body is out of range: {_NUMBER_LIMIT}.")
    return bad_request(f"{field}: the number is out of range: {_NUMBER_LIMIT}.", param=field)


def _body_type(handler: Any) -> Any:
    """The type a route handler takes its JSON body as (its ``data`` argument), or None (no body, a DTO's)."""
    field = handler.parsed_fn_signature.parameters.get("data")
    if field is None or field.annotation is Any or handler.resolve_data_dto() is not None:
        return None
    return field.annotation


class JsonBodyRequest(Request):
    """The app's request class: :meth:`json` converts the body to the handler's body type strictly (a
    value of another JSON type is a 400 naming the field and the type it takes), answers an out-of-range
    number with a 400 naming the field, and a body nested deeper than the decoder can recurse with a 400."""

    async def json(self) -> Any:
        """The body as the handler's ``data`` type (plain JSON values where the handler takes none)."""
        value = await self._parsed_json()
        handler = self.route_handler
        body_type = _body_type(handler)
        if body_type is None:
            return value
        try:
            return msgspec.convert(value, body_type, strict=True, str_keys=True,
                                   dec_hook=handler.default_deserializer)
        except msgspec.ValidationError as exc:
            raise self._validation_error(str(exc), value) from None

    def _validation_error(self, error: str, body: Any) -> ValidationException:
        """The error in the shape Litestar gives its own validation errors (errors.py words it)."""
        return ValidationException(detail=f"Validation failed for {self.method} {self.url.path}",
                                   extra=[validation_detail(error, body)])

    async def _parsed_json(self) -> Any:
        try:
            return await super().json()
        except RecursionError:
            # how deep the decoder may go depends on the stack it starts from (Python's recursion limit, 1000):
            # no request field nests more than a few levels, so any body this deep is malformed
            raise bad_request("The JSON body nests objects or arrays too deeply to parse (about "
                              f"{sys.getrecursionlimit()} levels); no request field nests more than a few.") from None
        except SerializationException as exc:
            if _OUT_OF_RANGE not in str(exc.detail):
                raise
            raise out_of_range(out_of_range_field(await self.body())) from None
