"""Jinja rendering for the console: one environment, security headers on every page."""

from __future__ import annotations

import base64
import json
import secrets
from datetime import datetime, timezone
from pathlib import Path

import jinja2
from litestar import MediaType, Request, Response
from litestar.response import Redirect

from loraplex import __version__
from loraplex.platform.console.refused import MAX_TYPED_VALUE, Refused, typed_fields
from loraplex.platform.console.session import CSRF_FIELD, Session, cookie_is_secure

HERE = Path(__file__).resolve().parent
TEMPLATES = HERE / "templates"
STATIC = HERE / "static"
FLASH_COOKIE = "lpx_console_flash"

# no inline script or style anywhere: the console's own files only, nothing from other origins
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "form-action 'self'; frame-ancestors 'none'; base-uri 'none'; object-src 'none'"
)
PAGE_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    # pages can show a secret once (new keys): never keep them in any cache
    "Cache-Control": "no-store",
}


def _ago(value: datetime | None) -> str:
    if value is None:
        return "never"
    if value.tzinfo is None:
        value = value.replace(tzinfo=timezone.utc)
    s = (datetime.now(timezone.utc) - value).total_seconds()
    if s < 0:
        return "in " + _span(-s)
    return _span(s) + " ago"


def _span(s: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{int(s // size)}{unit}"
    return f"{int(s)}s"


def _when(value: datetime | None) -> str:
    if value is None:
        return "—"
    if value.tzinfo is None:
        value = value.replace(tzinfo=timezone.utc)
    return value.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def _past(value: datetime | None) -> bool:
    if value is None:
        return False
    if value.tzinfo is None:
        value = value.replace(tzinfo=timezone.utc)
    return value <= datetime.now(timezone.utc)


def _num(value) -> str:
    if value is None:
        return "—"
    if isinstance(value, float) and not value.is_integer():
        return f"{value:,.2f}"
    return f"{int(value):,}"


def _bytes(value) -> str:
    if value is None:
        return "—"
    n = float(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(value)


env = jinja2.Environment(
    loader=jinja2.FileSystemLoader(str(TEMPLATES)),
    autoescape=jinja2.select_autoescape(["html", "svg"]),
    trim_blocks=True,
    lstrip_blocks=True,
    undefined=jinja2.StrictUndefined,
)
env.filters.update(ago=_ago, when=_when, num=_num, bytes=_bytes, past=_past)
env.globals.update(version=__version__, csrf_field=CSRF_FIELD,
                   # a fresh id per rendered form whose repeat would repeat its effect (a reload of "key created")
                   form_id=lambda: secrets.token_urlsafe(16))


def nav_items(session: Session | None) -> list[tuple[str, str, str]]:
    """(key, label, href) of the navigation, by role."""
    if session is None:
        return []
    items = [("overview", "Overview", "/console")]
    if session.principal.is_admin:
        items.append(("tenants", "Tenants", "/console/tenants"))
    items += [
        ("keys", "API keys", "/console/keys"),
        ("adapters", "Adapters", "/console/adapters"),
        ("usage", "Usage", "/console/usage"),
        ("playground", "Playground", "/console/playground"),
    ]
    return items


MAX_FLASH = 400  # characters of a flash message
MAX_FLASH_COOKIE = 3800  # bytes: browsers keep a cookie of up to 4 KB, name and attributes included


def _flash_data(request: Request) -> dict:
    """What the previous redirect left in the flash cookie (see :func:`redirect`); {} when none or unreadable."""
    raw = request.cookies.get(FLASH_COOKIE)
    try:
        data = json.loads(base64.urlsafe_b64decode(raw.encode())) if raw else {}
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def read_flash(request: Request) -> tuple[str | None, str | None]:
    """(message, error) carried by the flash cookie of the previous redirect."""
    data = _flash_data(request)
    if "m" not in data:
        return None, None
    text = str(data["m"])[:MAX_FLASH]
    return (None, text) if data.get("k") == "error" else (text, None)


def read_refused(request: Request) -> Refused:
    """The form refused by the previous request, as typed (``a``: the path it was posted to, ``p``: the field
    its error is about, ``f``: the fields), when the flash cookie carries one."""
    data = _flash_data(request)
    fields, action = data.get("f"), data.get("a")
    if data.get("k") != "error" or not isinstance(fields, dict) or not isinstance(action, str):
        return Refused()
    return Refused(action, {str(k): str(v)[:MAX_TYPED_VALUE] for k, v in fields.items()},
                   str(data["p"]) if data.get("p") else None, str(data.get("m") or "")[:MAX_FLASH])


def redirect(request: Request, path: str, flash: str | None = None, error: str | None = None,
             param: str | None = None, typed: dict[str, str] | None = None) -> Redirect:
    """303 to ``path`` (a console path); ``flash``/``error`` is shown once on the next page, with the
    ``typed`` fields (see :func:`refused.typed_fields`) filled in again and ``param`` marked."""
    assert path.startswith("/console")
    response = Redirect(path, status_code=303, headers={"Cache-Control": "no-store"})
    if flash or error:
        data = {"k": "error" if error else "ok", "m": (error or flash)[:MAX_FLASH], "p": param}
        if typed is not None:
            data.update(f=typed_fields(typed), a=request.url.path)
        value = _cookie_value(data)
        if len(value) > MAX_FLASH_COOKIE:  # the message alone always fits; the fields only where they do
            value = _cookie_value({k: v for k, v in data.items() if k not in ("f", "a")})
        response.set_cookie(FLASH_COOKIE, value, path="/console", httponly=True, samesite="strict",
                            secure=cookie_is_secure(request.scope), max_age=60)
    return response


def _cookie_value(data: dict) -> str:
    return base64.urlsafe_b64encode(json.dumps(data, ensure_ascii=False).encode()).decode()


def render(template: str, **ctx) -> str:
    return env.get_template(template).render(**ctx)


def page(
    request: Request, template: str, session: Session | None, *, active: str = "", status_code: int = 200,
    flash: str | None = None, error: str | None = None, **ctx,
) -> Response:
    carried_flash, carried_error = read_flash(request)
    html = render(
        template, session=session, principal=session.principal if session else None,
        csrf=session.csrf if session else "", nav=nav_items(session), active=active,
        flash=flash or carried_flash, error=error or carried_error,
        base_url=str(request.base_url).rstrip("/"),
        refused=read_refused(request) if carried_error and not error else Refused(), **ctx,
    )
    response = Response(html, media_type=MediaType.HTML, status_code=status_code, headers=PAGE_HEADERS)
    if FLASH_COOKIE in request.cookies:
        response.delete_cookie(FLASH_COOKIE, path="/console")
    return response


def fragment(template: str, **ctx) -> Response:
    return Response(render(template, **ctx), media_type=MediaType.HTML, headers=PAGE_HEADERS)
