"""``/console``: routes of the admin console (the app factory picks this module up by name)."""

from __future__ import annotations

import logging
from urllib.parse import quote, urlsplit

from litestar import MediaType, Request, Response, Router, get
from litestar.datastructures import CacheControlHeader
from litestar.exceptions import HTTPException
from litestar.static_files import create_static_files_router

from loraplex.platform.console import (
    pages_adapters,
    pages_auth,
    pages_keys,
    pages_overview,
    pages_playground,
    pages_tenants,
    pages_usage,
    proxy,
)
from loraplex.platform.console.deps import session_of
from loraplex.platform.console.render import STATIC, page, read_flash, redirect
from loraplex.platform.console.session import COOKIE, CSRF_HEADER, LoginRequired
from loraplex.platform.errors import ApiError
from loraplex.platform.middleware import loggable_path

log = logging.getLogger(__name__)


def _to_login(request: Request, exc: LoginRequired) -> Response:
    if request.headers.get("x-console-fetch") or request.headers.get(CSRF_HEADER):
        # the page's scripts (they send one of these headers) learn it plainly, then go to the sign-in form
        return Response({"error": {"message": exc.reason or "Sign in first.", "type": "invalid_request_error",
                                   "code": "not_signed_in"}}, status_code=401, media_type=MediaType.JSON)
    if request.method == "GET":
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    else:  # a form posted from a page after its session ended: sign in, then back to that page (the form is lost)
        target = _same_console_page(request) or "/console"
    carried, _ = read_flash(request)  # e.g. "Key ... revoked": the action that ended this session
    reason = " ".join(filter(None, (carried, exc.reason))) or None
    response = redirect(request, f"/console/login?next={quote(target, safe='/')}", error=reason)
    response.delete_cookie(COOKIE, path="/console")  # its record is gone
    return response


def _same_console_page(request: Request) -> str | None:
    """The console page a form was posted from (same origin), to return to with the error shown."""
    referer = request.headers.get("referer")
    if not referer:
        return None
    parts = urlsplit(referer)
    if parts.netloc != request.headers.get("host") or not parts.path.startswith("/console"):
        return None
    return parts.path + (f"?{parts.query}" if parts.query else "")


def _on_error(request: Request, exc: HTTPException) -> Response:
    status = exc.status_code
    message = exc.message if isinstance(exc, ApiError) else str(exc.detail or "Something went wrong.")
    if status >= 500:
        log.error("console error on %s %s: %s", request.method, loggable_path(request.url.path), message)
    back = _same_console_page(request) if request.method == "POST" else None
    if back and status < 500:
        # a form the user filled in wrongly, or an action refused (403, or 404 for what it named): back to the
        # form, with the reason
        return redirect(request, back, error=message, param=exc.param if isinstance(exc, ApiError) else None,
                        typed=request.state.get("console_form"))
    session = request.state.get("console_session")
    return page(request, "error.html", session, status_code=status, status=status, message=message)


def _on_internal(request: Request, exc: Exception) -> Response:
    """A fault in a console page: the console's error page (the API's JSON error is not for a browser)."""
    log.exception("console error on %s %s", request.method, loggable_path(request.url.path), exc_info=exc)
    return page(request, "error.html", request.state.get("console_session"), status_code=500, status=500,
                message="The console had an error while showing this page. Try again; if it persists, the server's "
                        "log has the details.")


def _static_missing(request: Request, exc: HTTPException) -> Response:
    """A console file that does not exist: the console's 404 page, not the API's JSON."""
    if exc.status_code != 404:
        return _on_error(request, exc)
    return page(request, "error.html", request.state.get("console_session"), status_code=404, status=404,
                message=f"There is no console page at {request.url.path}.")


@get("/{rest:path}", include_in_schema=False)
async def no_such_page(request: Request, rest: str) -> Response:
    """Any other console path: the console's own 404 page."""
    session = await session_of(request)
    return page(request, "error.html", session, status_code=404, status=404,
                message=f"There is no console page at {request.url.path}.")


@get("/logout", include_in_schema=False, status_code=303)
async def logout_link(request: Request) -> Response:
    """Signing out is a form post (CSRF); a typed or followed link to it goes to the overview, signed in or not."""
    return redirect(request, "/console")


def route_handlers() -> list:
    pages = (pages_auth.handlers() + pages_overview.handlers() + pages_tenants.handlers() + pages_keys.handlers()
             + pages_adapters.handlers() + pages_usage.handlers() + pages_playground.handlers() + proxy.handlers()
             + [logout_link, no_such_page])
    return [
        Router(
            path="/console",
            route_handlers=pages,
            exception_handlers={LoginRequired: _to_login, ApiError: _on_error, HTTPException: _on_error,
                                Exception: _on_internal},
            include_in_schema=False,
        ),
        create_static_files_router(
            path="/console/static", directories=[STATIC], include_in_schema=False,
            exception_handlers={HTTPException: _static_missing},
            cache_control=CacheControlHeader(max_age=300),
        ),
    ]
