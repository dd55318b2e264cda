"""Per-request helpers for console handlers: the session, CSRF checks, role checks."""

from __future__ import annotations

from litestar import Request

from loraplex.platform.console.session import (
    COOKIE,
    CSRF_FIELD,
    CSRF_HEADER,
    CsrfError,
    Session,
    SessionStore,
    tokens_equal,
)
from loraplex.platform.errors import ApiError


def store(request: Request) -> SessionStore:
    return SessionStore(request.app.state.services)


async def session_of(request: Request) -> Session:
    """The signed-in session (raises :class:`LoginRequired`); cached on the request."""
    cached = request.state.get("console_session")
    if cached is not None:
        return cached
    session = await store(request).load(request.cookies.get(COOKIE))
    request.state.console_session = session
    # platform code that calls principal_of(request) sees the session's principal
    request.state.principal = session.principal
    return session


async def form_of(request: Request, session: Session) -> dict[str, str]:
    """The submitted form, after the CSRF check (field or header)."""
    form = await request.form()
    data = {k: (v if isinstance(v, str) else "") for k, v in form.items()}
    sent = data.get(CSRF_FIELD) or request.headers.get(CSRF_HEADER)
    if not tokens_equal(sent, session.csrf):
        raise CsrfError()
    request.state.console_form = data  # an error sends the user back to the form with these filled in
    return data


def check_csrf_header(request: Request, session: Session) -> None:
    if not tokens_equal(request.headers.get(CSRF_HEADER), session.csrf):
        raise CsrfError()


def require_admin(session: Session) -> None:
    if not session.principal.is_admin:
        raise ApiError(403, "This page is for platform operators (admin keys) only.", type="permission_error",
                       code="insufficient_scope")


INT32_MAX = 2**31 - 1  # the largest limit the API stores in an integer column


def whole_number(data: dict[str, str], field: str, label: str, *, minimum: int = 1, maximum: int | None = INT32_MAX,
                 unit: str = "", blank: str = "blank = the default") -> int | None:
    """The one check of every number field: ASCII digits only (``,`` and ``_`` allowed as separators), within
    ``minimum..maximum``; blank is None. Errors name the form's ``label`` and say what blank means."""
    raw = (data.get(field) or "").strip()
    if not raw:
        return None
    digits = raw.replace(",", "").replace("_", "")
    what = f"a whole number{' of ' + unit if unit else ''}"
    if not (digits.isascii() and digits.isdigit()):
        raise ApiError(400, f"{label} must be {what} ({blank}), got {raw[:40]!r}.", param=field)
    value = int(digits)
    if value < minimum or (maximum is not None and value > maximum):
        bound = f"between {minimum:,} and {maximum:,}" if maximum is not None else f"at least {minimum:,}"
        raise ApiError(400, f"{label} must be {bound} ({blank}).", param=field)
    return value


def optional_int(data: dict[str, str], field: str, label: str) -> int | None:
    """A positive int from a form field; blank means "server default" (None)."""
    return whole_number(data, field, label)
