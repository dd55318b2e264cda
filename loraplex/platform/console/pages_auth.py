"""Sign in with an API key, sign out."""

from __future__ import annotations

import secrets

from litestar import Request, Response, get, post
from litestar.response import Redirect

from loraplex.platform.console.deps import form_of, session_of, store
from loraplex.platform.console.render import page, read_flash, redirect
from loraplex.platform.console.session import (
    COOKIE,
    CSRF_FIELD,
    PRE_COOKIE,
    PRE_TTL_S,
    SESSION_TTL_S,
    LoginRequired,
    cookie_is_secure,
    login_token,
    tokens_equal,
)
from loraplex.platform.errors import ApiError


def _safe_next(value: str | None) -> str:
    # only console paths on this origin: no open redirect through "next"
    if value and value.startswith("/console") and "//" not in value and "\\" not in value and len(value) < 300:
        return value
    return "/console"


def _login_page(request: Request, pre: str, *, error: str | None = None, status_code: int = 200) -> Response:
    secret = request.app.state.services.server_secret
    response = page(request, "login.html", None, error=error, status_code=status_code,
                    login_csrf=login_token(secret, pre), next=_safe_next(request.query_params.get("next")))
    response.set_cookie(PRE_COOKIE, pre, path="/console", httponly=True, samesite="strict",
                        secure=cookie_is_secure(request.scope), max_age=PRE_TTL_S)
    return response


@get("/login", include_in_schema=False)
async def login_form(request: Request) -> Response:
    try:
        await session_of(request)
        return redirect(request, "/console")
    except LoginRequired as exc:
        pre = request.cookies.get(PRE_COOKIE) or secrets.token_urlsafe(24)
        # the reason carried from the page that found the session over (key revoked, tenant suspended) says more
        # than this second look, which only finds the record gone
        return _login_page(request, pre, error=read_flash(request)[1] or exc.reason or None)


@post("/login", include_in_schema=False, status_code=303)
async def login(request: Request) -> Response:
    form = await request.form()
    pre = request.cookies.get(PRE_COOKIE) or ""
    secret = request.app.state.services.server_secret
    if not pre or not tokens_equal(form.get(CSRF_FIELD), login_token(secret, pre)):
        return _login_page(request, secrets.token_urlsafe(24), status_code=403,
                           error="The sign-in form expired; please try again.")
    raw_key = str(form.get("api_key") or "").strip()
    try:
        sid, _ = await store(request).create(raw_key)
    except ApiError as exc:
        message = "That API key is not valid (revoked, expired, or its tenant is suspended)." \
            if raw_key else "Paste an API key (lpx-...) to sign in."
        if exc.status_code != 401:
            message = exc.message
        return _login_page(request, pre, error=message, status_code=401)
    response = Redirect(_safe_next(str(form.get("next") or "")), status_code=303)
    response.set_cookie(COOKIE, sid, path="/console", httponly=True, samesite="strict",
                        secure=cookie_is_secure(request.scope), max_age=SESSION_TTL_S)
    response.delete_cookie(PRE_COOKIE, path="/console")
    return response


@post("/logout", include_in_schema=False, status_code=303)
async def logout(request: Request) -> Response:
    session = await session_of(request)
    await form_of(request, session)
    await store(request).destroy(session.sid)
    response = Redirect("/console/login", status_code=303)
    response.delete_cookie(COOKIE, path="/console")
    return response


def handlers() -> list:
    return [login_form, login, logout]
