"""Console sessions: sign in with an API key, then a cookie.

The cookie holds only a random session id. The server keeps, in the KV store (Redis or in-process),
a record under ``sha256(session id)`` with the CSRF token and the API key *encrypted with a keystream
derived from the session id*, so a leaked KV dump reveals neither live session ids nor keys. Every
request re-authenticates the decrypted key through the platform's :class:`Authenticator`, so a revoked
key or a suspended tenant ends the session within the auth cache's TTL (pub/sub invalidation).

CSRF: one random token per session, sent back in a hidden ``_csrf`` field of every form and in the
``X-CSRF-Token`` header of every state-changing fetch. The sign-in form itself (no session yet) uses a
signed double-submit token bound to a short-lived pre-session cookie.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import secrets
import time
from dataclasses import dataclass

from loraplex.platform.auth import Principal
from loraplex.platform.errors import ApiError

log = logging.getLogger(__name__)

COOKIE = "lpx_console"
PRE_COOKIE = "lpx_console_login"  # only while the sign-in form is open
SESSION_TTL_S = 8 * 3600
PRE_TTL_S = 3600
CSRF_FIELD = "_csrf"
CSRF_HEADER = "x-csrf-token"
_KV_PREFIX = "console:session:"
_SID_BYTES = 32


class LoginRequired(Exception):
    """No valid session: pages redirect to the sign-in form, APIs answer 401."""

    def __init__(self, reason: str = ""):
        super().__init__(reason)
        self.reason = reason


class CsrfError(ApiError):
    def __init__(self) -> None:
        super().__init__(403, "The form expired or did not come from this console; reload the page and try again.",
                         type="permission_error", code="csrf_failed")


@dataclass(frozen=True)
class Session:
    sid: str
    csrf: str
    principal: Principal
    raw_key: str  # decrypted for this request only; never rendered


def _store_down(exc: Exception) -> ApiError:
    # Redis down: fail closed with a plain 503 (pages render it; scripts get the JSON error)
    log.warning("console session store unavailable: %s", exc)
    return ApiError(503, "The session store is unavailable; try again shortly.", type="server_error",
                    code="session_store_unavailable", headers={"Retry-After": "5"})


def _kv_key(sid: str) -> str:
    return _KV_PREFIX + hashlib.sha256(sid.encode()).hexdigest()


def _keystream(sid: str, n: int) -> bytes:
    # HMAC-SHA256 in counter mode as a PRF keystream; each session id encrypts exactly one key
    out = b""
    counter = 0
    while len(out) < n:
        out += hmac.new(sid.encode(), b"console-key:" + counter.to_bytes(4, "big"), hashlib.sha256).digest()
        counter += 1
    return out[:n]


def seal_key(sid: str, key: str) -> str:
    data = key.encode()
    return base64.b64encode(bytes(a ^ b for a, b in zip(data, _keystream(sid, len(data))))).decode()


def open_key(sid: str, sealed: str) -> str:
    data = base64.b64decode(sealed)
    # a wrong session id yields garbage (never a valid key), not an exception
    return bytes(a ^ b for a, b in zip(data, _keystream(sid, len(data)))).decode(errors="replace")


def tokens_equal(a: str | None, b: str | None) -> bool:
    return bool(a) and bool(b) and hmac.compare_digest(a.encode(), b.encode())


class SessionStore:
    def __init__(self, services):
        self._services = services

    async def create(self, raw_key: str) -> tuple[str, Principal]:
        """Authenticate ``raw_key`` (raises the platform's 401) and open a session; returns (sid, principal)."""
        principal = await self._services.authenticator.authenticate(raw_key)
        sid = secrets.token_urlsafe(_SID_BYTES)
        record = {"k": seal_key(sid, raw_key), "csrf": secrets.token_urlsafe(24), "t": int(time.time())}
        try:
            await self._services.kv.set(_kv_key(sid), json.dumps(record), ttl_s=SESSION_TTL_S)
        except Exception as exc:
            raise _store_down(exc) from exc
        log.info("console sign-in tenant=%s key=%s", principal.tenant_name, principal.key_id)
        return sid, principal

    async def load(self, sid: str | None) -> Session:
        if not sid or len(sid) > 128:
            raise LoginRequired()
        try:
            raw = await self._services.kv.get(_kv_key(sid))
        except Exception as exc:
            raise _store_down(exc) from exc
        if raw is None:
            raise LoginRequired("Your session has ended; sign in again.")
        record = json.loads(raw)
        key = open_key(sid, record["k"])
        try:
            principal = await self._services.authenticator.authenticate(key)
        except ApiError as exc:
            # revoked key, expired key or suspended tenant: the session dies with it
            await self.destroy(sid)
            raise LoginRequired("Your API key is no longer valid; sign in again.") from exc
        return Session(sid=sid, csrf=record["csrf"], principal=principal, raw_key=key)

    async def destroy(self, sid: str | None) -> None:
        if sid:
            await self._services.kv.delete(_kv_key(sid))


def login_token(secret: bytes, pre: str) -> str:
    """The sign-in form's CSRF token: bound to the pre-session cookie by the server secret."""
    return hmac.new(secret, b"console-login:" + pre.encode(), hashlib.sha256).hexdigest()


def cookie_is_secure(scope) -> bool:
    """Secure cookies when the browser reached us over TLS (directly or through a TLS proxy)."""
    if scope.get("scheme") in ("https", "wss"):
        return True
    for name, value in scope.get("headers", ()):
        if name == b"x-forwarded-proto":
            return value.decode("latin-1").split(",")[0].strip().lower() == "https"
    return False
