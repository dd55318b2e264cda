"""OpenAI-style errors: every error response is ``{"error": {"message", "type", "param", "code"}}``.

Raise :class:`ApiError` (or a helper below) from any handler; :func:`exception_handlers` maps it and
every framework exception (404, 405, 422 validation, 500) to the same shape.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import msgspec
from litestar import MediaType, Request, Response
from litestar.exceptions import HTTPException, ValidationException

log = logging.getLogger(__name__)


class ErrorBody(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(msgspec.Struct):
    """The body of every error response."""

    error: ErrorBody


class ApiError(HTTPException):
    """An error a client can cause; never logged as a server fault."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(detail=message, status_code=status_code, headers=headers)
        self.message = message
        self.type = type
        self.param = param
        self.code = code


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def unauthorized(message: str = "Invalid API key") -> ApiError:
    return ApiError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def forbidden(message: str, param: str | None = None) -> ApiError:
    return ApiError(403, message, type="permission_error", param=param, code="insufficient_scope")


def not_found(message: str, param: str | None = None, code: str | None = "not_found") -> ApiError:
    return ApiError(404, message, param=param, code=code)


# longer than any model id can be (``<tenant>/<adapter>@<version>`` is at most 160 characters)
MAX_SHOWN_MODEL_CHARS = 160


def model_not_found(model: str) -> ApiError:
    # identical for "does not exist" and "belongs to another tenant": it depends on the name alone
    shown = model
    if len(model) > MAX_SHOWN_MODEL_CHARS:  # never echo a huge name back (the client has it)
        shown = f"{model[:MAX_SHOWN_MODEL_CHARS]}... ({len(model)} characters)"
    return ApiError(
        404, f"The model '{shown}' does not exist or you do not have access to it.",
        param="model", code="model_not_found",
    )


def rate_limited(message: str, retry_after_s: int, headers: dict[str, str], code: str = "rate_limit_exceeded"):
    return ApiError(
        429, message, type="rate_limit_error", code=code, headers={"Retry-After": str(retry_after_s), **headers}
    )


def overloaded(message: str, retry_after_s: int = 1) -> ApiError:
    return ApiError(503, message, type="server_error", code="overloaded", headers={"Retry-After": str(retry_after_s)})


def error_response(
    status_code: int, message: str, type: str, param: str | None = None, code: str | None = None,
    headers: dict[str, str] | None = None,
) -> Response[Any]:
    return Response(
        content=ErrorResponse(ErrorBody(message=message, type=type, param=param, code=code)),
        status_code=status_code,
        media_type=MediaType.JSON,
        headers=headers,
    )


_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}
_CODES = {401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed", 413: "payload_too_large"}


_MISSING_FIELD = re.compile(r"missing required field `([^`]+)`")
# Litestar names the request body by the handler's argument, "data": that is no field of the request
_BODY_KEYS = (None, "", "data")
# what Litestar reports when a route that takes a body gets none (a KeyError of that argument)
_NO_BODY = "'data'"


def validation_param(extra: Any) -> str | None:
    """The field a validation error (its ``extra``: Litestar's list of details) is about."""
    if isinstance(extra, list) and extra and isinstance(extra[0], dict):
        key = extra[0].get("key")
        # a missing field is reported at its parent (the body itself, or the object holding it): name the field
        missing = _MISSING_FIELD.search(str(extra[0].get("message", "")))
        if missing:
            return missing.group(1) if key in _BODY_KEYS else f"{key}.{missing.group(1)}"
        return None if key in _BODY_KEYS else str(key)  # the body as a whole (not an object, or none) has no param
    return None


_REGEX_DETAIL = re.compile(r"Expected `str` matching regex ('.*')")
# msgspec's words for a value of the wrong JSON type: "Expected `int | null`, got `str`"
TYPE_MISMATCH = re.compile(r"Expected `([^`]+)`, got `(\w+)`")
_TYPE_WORDS = {"int": "an integer", "float": "a number", "str": "a string", "bool": "a boolean",
               "array": "an array", "object": "an object", "null": "null"}
_GOT_WORDS = {**_TYPE_WORDS, "float": "a decimal number"}  # OpenAI's words: a float is never an integer


def _invalid_type_message(param: str | None, expected: str, got: str) -> str:
    """OpenAI's message for a value of the wrong type, from msgspec's type names: ``Invalid type for
    'max_tokens': expected an integer, but got a string instead.`` (null is left out of what a field
    takes, as OpenAI leaves it out)."""
    names = [n for n in expected.split(" | ") if n != "null"] or ["null"]
    words = [_TYPE_WORDS.get(n, f"`{n}`") for n in names]
    takes = words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"
    field = f"'{param}'" if param else "the request body"
    return f"Invalid type for {field}: expected {takes}, but got {_GOT_WORDS.get(got, f'`{got}`')} instead."


def invalid_type(param: str, expected: str, got: str, note: str = "") -> ApiError:
    """A value of the wrong type that only a check after the body's conversion finds (types in msgspec's names,
    as in its own errors: ``"str | array"``, ``"null"``), worded and coded as the body's type errors."""
    message = _invalid_type_message(param, expected, got)
    return ApiError(400, f"{message} {note}".strip(), param=param, code="invalid_type")


def validation_message(message: str, extra: Any) -> tuple[str, str]:
    """The message and code of a framework validation error (``message``: its detail, ``extra``: Litestar's list of
    details): ``invalid_type`` (OpenAI's code) for a body value of the wrong JSON type, ``invalid_value`` for
    anything else (a missing field, a malformed body)."""
    if isinstance(extra, list) and extra and isinstance(extra[0], dict):
        detail = str(extra[0].get("message", ""))
        if detail == _NO_BODY and extra[0].get("key") in _BODY_KEYS:
            return f"{message}: the request body is empty; send a JSON object.", "invalid_value"
        mismatch = TYPE_MISMATCH.fullmatch(detail)
        if mismatch and extra[0].get("source") == "body":  # a query string's values are all strings
            return _invalid_type_message(validation_param(extra), *mismatch.groups()), "invalid_type"
        pattern = _REGEX_DETAIL.fullmatch(detail)
        if pattern and extra[0].get("key"):  # msgspec's words name the type, not the field
            detail = f"{extra[0]['key']} does not have the form the pattern {pattern.group(1)} describes"
        message = f"{message}: {detail}".rstrip(": ")
    return message, "invalid_value"


def _handle_api_error(_: Request, exc: ApiError) -> Response[Any]:
    return error_response(exc.status_code, exc.message, exc.type, exc.param, exc.code, exc.headers)


def _body_limit(request: Request) -> int | None:
    try:
        return request.route_handler.resolve_request_max_body_size()
    except Exception:  # noqa: BLE001 (no route: the message goes without the number)
        return None


def _sent_name(request: Request, param: str | None) -> str | None:
    """Litestar names a handler's argument; one declared under another name (``start`` for the query's ``from``)
    is named as the client sent it."""
    try:
        kwarg = request.route_handler.parsed_fn_signature.parameters[param].kwarg_definition
    except (AttributeError, KeyError):
        return param
    return getattr(kwarg, "query", None) or getattr(kwarg, "header", None) or param


def _handle_http(request: Request, exc: HTTPException) -> Response[Any]:
    status = exc.status_code
    param = None
    message = str(exc.detail or "error")
    code = _CODES.get(status, "invalid_value" if status == 400 else None)
    if status == 400 and message == "Input data was truncated":  # msgspec's words for JSON that ends early
        message = "JSON is malformed: the body ends before the JSON value does (truncated)"
    if status == 413 and message == "Request Entity Too Large":  # the framework's body limit, which it leaves unnamed
        limit = _body_limit(request)
        message = "The request body is too large" + (f": at most {limit:,} bytes are accepted." if limit else ".")
    if isinstance(exc, ValidationException):
        # framework validation (malformed JSON, wrong types, missing fields): 400 like OpenAI
        status = 400
        param = _sent_name(request, validation_param(exc.extra))
        message, code = validation_message(str(exc.detail or "error"), exc.extra)
    if status >= 500:
        return error_response(status, message, "server_error", code="server_error", headers=exc.headers)
    return error_response(status, message, _TYPES.get(status, "invalid_request_error"), param, code, exc.headers)


def _where(request: Request) -> str:
    """The request's path as the access log writes it (a key's secret redacted, bounded, control characters escaped)."""
    from loraplex.platform.middleware import loggable_path  # (middleware imports this module)

    return loggable_path(request.url.path)


def _handle_internal(request: Request, exc: Exception) -> Response[Any]:
    log.exception("unhandled error on %s %s", request.method, _where(request), exc_info=exc)
    return error_response(500, "The server had an error while processing your request.", "server_error",
                          code="internal_error")


def _sqlstate(exc: Exception) -> str | None:
    orig = getattr(exc, "orig", None)
    for candidate in (orig, getattr(orig, "__cause__", None)):
        code = getattr(candidate, "sqlstate", None)
        if isinstance(code, str):
            return code
    return None


def _handle_db(request: Request, exc: Exception) -> Response[Any]:
    """A value the database cannot store (e.g. a NUL byte in text on Postgres) is the client's error;
    an unreachable database is a 503 (readiness reports it), never a bare 500."""
    from sqlalchemy.exc import InterfaceError, OperationalError

    state = _sqlstate(exc) or ""
    if state.startswith("22"):  # SQLSTATE class 22: data exception
        return error_response(400, "A parameter contains characters or a value the server cannot store.",
                              "invalid_request_error", code="invalid_value")
    if isinstance(exc, (OperationalError, InterfaceError)) or state.startswith("08"):
        return _database_unavailable(request, exc)
    return _handle_internal(request, exc)


def _handle_pool_timeout(request: Request, exc: Exception) -> Response[Any]:
    """Every pooled connection busy past LORAPLEX_DATABASE_POOL_TIMEOUT_S (SQLAlchemy's pool TimeoutError is not a
    DBAPI error): an overloaded replica, a 503 to retry like an unreachable database, never a 500."""
    log.warning("database pool exhausted on %s %s: %s", request.method, _where(request), exc)
    return error_response(503, "All of the server's database connections are busy; retry shortly.", "server_error",
                          code="database_unavailable", headers={"Retry-After": "2"})


def _database_unavailable(request: Request, exc: Exception) -> Response[Any]:
    log.warning("database unavailable on %s %s: %r", request.method, _where(request), exc)
    return error_response(503, "The database is unavailable; retry shortly.", "server_error",
                          code="database_unavailable", headers={"Retry-After": "2"})


_DATABASE_DRIVERS = frozenset({"sqlalchemy", "asyncpg", "aiosqlite"})


def _raised_in_database_driver(exc: BaseException) -> bool:
    tb = exc.__traceback__
    while tb is not None:
        if str(tb.tb_frame.f_globals.get("__name__", "")).split(".")[0] in _DATABASE_DRIVERS:
            return True
        tb = tb.tb_next
    return False


def _handle_os_error(request: Request, exc: Exception) -> Response[Any]:
    """When the pool opens a connection, asyncpg raises the socket's own error (refused, reset, timed out)
    and SQLAlchemy passes it on untranslated: the database is unreachable, a 503 like any other outage of it.
    Any other OSError is a server fault."""
    if _raised_in_database_driver(exc):
        return _database_unavailable(request, exc)
    return _handle_internal(request, exc)


def _handle_redis(request: Request, exc: Exception) -> Response[Any]:
    """Redis (rate limits, caches) unreachable: fail closed with a 503, never admit unlimited traffic."""
    log.warning("redis unavailable on %s %s: %s", request.method, _where(request), exc)
    return error_response(503, "A backing service is unavailable; retry shortly.", "server_error",
                          code="service_unavailable", headers={"Retry-After": "2"})


def exception_handlers() -> dict:
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError
    from sqlalchemy.exc import DBAPIError
    from sqlalchemy.exc import TimeoutError as PoolTimeoutError

    return {ApiError: _handle_api_error, HTTPException: _handle_http, DBAPIError: _handle_db,
            PoolTimeoutError: _handle_pool_timeout,
            RedisConnectionError: _handle_redis, RedisTimeoutError: _handle_redis, OSError: _handle_os_error,
            Exception: _handle_internal}


# declare in OpenAPI: every route can fail with these
def error_responses(*codes: int) -> dict:
    from litestar.openapi.datastructures import ResponseSpec

    desc = {
        400: "Bad request (names the parameter)", 401: "Missing or invalid API key", 403: "Missing scope",
        404: "Not found", 409: "Conflict", 413: "Body too large", 422: "Unprocessable",
        429: "Rate limited (Retry-After)", 503: "Overloaded or draining (Retry-After)",
    }
    return {c: ResponseSpec(data_container=ErrorResponse, description=desc.get(c, "Error")) for c in codes}
