"""JSON request bodies: a number no 64-bit float can hold (``1e309``) is a 400 naming its field, and
objects or arrays nested too deeply to parse are a 400 (msgspec's decoder recurses, so a body of a few
kilobytes of ``[[[[...`` would otherwise end in a RecursionError: a 500 logged as a server fault).

Litestar parses a body into plain values before it converts them to the handler's type, so msgspec's
"Number out of range" comes without a field (``$[...]``). Only on that error is the body parsed again,
with Python's parser (which turns such a number into ``inf`` instead of failing), to find the field.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

from litestar import Request
from litestar.exceptions import SerializationException

from loraplex.platform.errors import bad_request

_OUT_OF_RANGE = "Number out of range"


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


class JsonBodyRequest(Request):
    """The app's request class: :meth:`json` answers an out-of-range number with a 400 naming the field, and
    a body nested deeper than the decoder can recurse with a 400."""

    async def json(self) -> Any:
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
            field = out_of_range_field(await self.body())
            limit = "a JSON number must be finite and within about ±1.8e308 (a 64-bit float)"
            if field is None:
                raise bad_request(f"A number in the request body is out of range: {limit}.") from None
            raise bad_request(f"{field}: the number is out of range: {limit}.", param=field) from None
