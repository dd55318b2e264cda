"""Sign-in, session cookies, CSRF on forms, sign-out, and a revoked key ending its session."""

from __future__ import annotations

import hashlib
import json

from loraplex.platform.console.session import COOKIE, _kv_key
from tests.unit.console.conftest import csrf_of, sign_in


async def test_pages_redirect_to_sign_in(capp):
    r = await capp.c.get("/console/usage?range=7d", follow_redirects=False)
    assert r.status_code == 303
    assert r.headers["location"] == "/console/login?next=/console/usage%3Frange%3D7d"


async def test_sign_in_sets_a_strict_httponly_cookie_and_keeps_no_secret_in_the_store(capp):
    r = await sign_in(capp.c, capp.admin_key)
    assert r.status_code == 303 and r.headers["location"] == "/console"
    cookie = next(v for v in r.headers.get_list("set-cookie") if v.startswith(COOKIE + "="))
    flags = {p.strip().lower() for p in cookie.split(";")[1:]}
    assert "httponly" in flags and "samesite=strict" in flags and "path=/console" in flags
    assert "secure" not in flags  # plain http here
    sid = cookie.split(";")[0].split("=", 1)[1]
    record = await capp.services.kv.get(_kv_key(sid))
    assert record is not None
    assert capp.admin_key not in record and sid not in record
    assert set(json.loads(record)) == {"k", "csrf", "t"}
    assert (await capp.c.get("/console")).status_code == 200


async def test_cookie_is_secure_behind_tls(capp):
    r = await capp.c.get("/console/login", headers={"x-forwarded-proto": "https"})
    assert "secure" in r.headers["set-cookie"].lower()


async def test_wrong_key_and_missing_form_token_are_refused(capp):
    r = await sign_in(capp.c, "lpx-aaaaaaaaaaaa-" + "B" * 40)
    assert r.status_code == 401 and "not valid" in r.text
    assert COOKIE not in capp.c.cookies
    capp.c.cookies.clear()
    # a cross-site post: no pre-session cookie, no token
    r = await capp.c.post("/console/login", data={"api_key": capp.admin_key})
    assert r.status_code == 403 and COOKIE not in capp.c.cookies


async def test_every_form_needs_the_csrf_token(capp):
    await sign_in(capp.c, capp.admin_key)
    r = await capp.c.post("/console/tenants", data={"name": "evil"})
    assert r.status_code == 403 and "did not come from this console" in r.text
    r = await capp.c.post("/console/tenants", data={"name": "evil", "_csrf": "forged"})
    assert r.status_code == 403
    assert (await capp.c.get("/console/tenants/evil")).status_code == 404
    token = await csrf_of(capp.c)
    r = await capp.c.post("/console/tenants", data={"name": "good", "_csrf": token}, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/console/tenants/good"
    # a token from another session does not work in this one
    capp.c.cookies.clear()
    await sign_in(capp.c, capp.admin_key)
    r = await capp.c.post("/console/tenants", data={"name": "evil2", "_csrf": token})
    assert r.status_code == 403


async def test_sign_out_needs_csrf_and_ends_the_session(capp):
    await sign_in(capp.c, capp.admin_key)
    sid = capp.c.cookies[COOKIE]
    assert (await capp.c.post("/console/logout")).status_code == 403
    token = await csrf_of(capp.c)
    r = await capp.c.post("/console/logout", data={"_csrf": token}, follow_redirects=False)
    assert r.status_code == 303
    assert await capp.services.kv.get(_kv_key(sid)) is None
    capp.c.cookies.set(COOKIE, sid, path="/console")  # a stolen cookie replayed after sign-out
    assert (await capp.c.get("/console", follow_redirects=False)).status_code == 303


async def test_revoking_the_key_ends_its_sessions(capp):
    key, key_id = await capp.tenant("acme")
    await sign_in(capp.c, key)
    assert (await capp.c.get("/console/keys")).status_code == 200
    admin = {"Authorization": f"Bearer {capp.admin_key}"}
    assert (await capp.c.delete(f"/admin/keys/{key_id}", headers=admin)).status_code == 200
    r = await capp.c.get("/console/keys", follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"].startswith("/console/login")
    # and the script API answers 401 rather than acting with the dead key
    assert (await capp.c.get("/console/api/v1/models")).status_code == 401


async def test_key_pages_never_show_hashes_and_secrets_only_once(capp):
    await sign_in(capp.c, capp.admin_key)
    await capp.tenant("acme")
    token = await csrf_of(capp.c)
    r = await capp.c.post("/console/keys", data={"_csrf": token, "tenant": "acme", "scope_inference": "1",
                                                 "name": "ci"})
    assert r.status_code == 201 and r.headers["cache-control"] == "no-store"
    import re

    secret = re.search(r"lpx-[a-z0-9]{12}-[A-Za-z0-9]{40}", r.text).group(0)
    listing = (await capp.c.get("/console/keys")).text
    tenant_page = (await capp.c.get("/console/tenants/acme")).text
    for text in (listing, tenant_page):
        assert secret not in text
        assert hashlib.sha256(secret.encode()).hexdigest() not in text
        assert hashlib.sha256(capp.admin_key.encode()).hexdigest() not in text
    assert secret.split("-")[1] in listing  # the public key id is listed


async def test_session_store_outage_fails_closed_with_503(capp):
    await sign_in(capp.c, capp.admin_key)
    kv = capp.services.kv

    async def down(*_a, **_k):
        raise ConnectionError("redis: connection refused")

    real_get = kv.get
    kv.get = down  # the store itself failing, as when Redis is unreachable
    try:
        page = await capp.c.get("/console/keys")
        api = await capp.c.get("/console/api/v1/models")
    finally:
        kv.get = real_get
    assert page.status_code == 503 and "session store is unavailable" in page.text
    assert api.status_code == 503 and api.json()["error"]["code"] == "session_store_unavailable"
    assert (await capp.c.get("/console/keys")).status_code == 200


async def test_an_admin_session_cannot_revoke_its_own_key_but_a_tenant_can(capp):
    """As over HTTP (409 own_key): revoking the admin key of the session would lock the operator out of the
    console, so it is refused with a message and nothing changes; a tenant may still revoke its own key (its
    session ends, the operator can issue another)."""
    await sign_in(capp.c, capp.admin_key)
    admin_id = capp.admin_key.split("-")[1]
    token = await csrf_of(capp.c)
    r = await capp.c.post(f"/console/keys/{admin_id}/revoke", data={"_csrf": token}, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/console/keys"
    page = await capp.c.get("/console/keys")
    assert page.status_code == 200 and f"Key {admin_id} is the admin key of this session and was not revoked" in page.text
    admin = {"Authorization": f"Bearer {capp.admin_key}"}
    assert (await capp.c.get("/admin/tenants", headers=admin)).status_code == 200  # still valid
    key, key_id = await capp.tenant("acme")
    capp.c.cookies.clear()
    await sign_in(capp.c, key)
    token = await csrf_of(capp.c)
    r = await capp.c.post(f"/console/keys/{key_id}/revoke", data={"_csrf": token}, follow_redirects=False)
    assert r.status_code == 303
    assert (await capp.c.get("/v1/models", headers={"Authorization": f"Bearer {key}"})).status_code == 401
