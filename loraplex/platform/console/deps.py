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
    return data


def check_csrf_header(request: Request, session: Session) -> None:
    if not tokens_equal(request.headers.get(CSRF_HEADER), session.csrf):
        raise CsrfError()


def require_admin(session: Session) -> None:
    if not session.principal.is_admin:
        raise ApiError(403, "This page is for platform operators (admin keys) only.", type="permission_error",
                       code="insufficient_scope")


def optional_int(data: dict[str, str], field: str, label: str) -> int | None:
    """A positive int from a form field; blank means "server default" (None)."""
    raw = (data.get(field) or "").strip().replace(",", "").replace("_", "")
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ApiError(400, f"{label} must be a whole number (or blank for the default), got {raw!r}.",
                       param=field) from None
    if value < 1:
        raise ApiError(400, f"{label} must be at least 1 (or blank for the default).", param=field)
    return value
