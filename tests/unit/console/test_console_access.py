"""What a tenant's session can reach: its own pages only; the script API acts with its own key only."""

from __future__ import annotations

import csv
import io
from pathlib import Path

from loraplex.platform.db import utcnow
from loraplex.platform.hooks import UsageEvent
from tests.conftest import adapter_dir
from tests.unit.console.conftest import csrf_of, sign_in


async def _upload(capp, key: str, name: str, manifest: dict) -> None:
    d = Path(adapter_dir(manifest, 0))
    files = {"config": ("adapter_config.json", (d / "adapter_config.json").read_bytes()),
             "weights": ("adapter_model.safetensors", (d / "adapter_model.safetensors").read_bytes())}
    r = await capp.c.post("/v1/adapters", data={"name": name}, files=files,
                          headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 201, r.text


async def test_a_tenant_cannot_open_another_tenants_pages(capp, tiny_model):
    acme_key, _ = await capp.tenant("acme")
    globex_key, globex_key_id = await capp.tenant("globex")
    await _upload(capp, globex_key, "globex-secret", tiny_model)
    await sign_in(capp.c, acme_key)
    assert (await capp.c.get("/console/tenants")).status_code == 403
    assert (await capp.c.get("/console/tenants/acme")).status_code == 200
    other = await capp.c.get("/console/tenants/globex")
    missing = await capp.c.get("/console/tenants/nobody")
    assert other.status_code == missing.status_code == 404
    assert (await capp.c.get("/console/adapters/globex/globex-secret")).status_code == 404
    listing = await capp.c.get("/console/adapters")
    assert "globex-secret" not in listing.text and "globex" not in listing.text
    assert "globex" not in (await capp.c.get("/console/keys")).text
    token = await csrf_of(capp.c)
    # acting on another tenant's objects by id: 404, nothing changes
    r = await capp.c.post(f"/console/keys/{globex_key_id}/revoke", data={"_csrf": token})
    assert r.status_code == 404
    assert (await capp.c.get("/v1/models", headers={"Authorization": f"Bearer {globex_key}"})).status_code == 200
    r = await capp.c.post("/console/adapters/globex/globex-secret/delete", data={"_csrf": token})
    assert r.status_code == 404
    for path in ("/console/tenants/globex/status", "/console/tenants/globex/limits", "/console/plans"):
        assert (await capp.c.post(path, data={"_csrf": token, "action": "suspend"})).status_code == 403
    # the key form cannot create keys for another tenant or escalate scopes
    r = await capp.c.post("/console/keys", data={"_csrf": token, "tenant": "globex", "scope_admin": "1"})
    assert r.status_code == 403
    r = await capp.c.post("/console/keys", data={"_csrf": token, "tenant": "globex", "scope_inference": "1"})
    assert r.status_code == 201 and "For tenant <strong>acme</strong>" in r.text


async def test_operator_sees_and_acts_on_every_tenant(capp, tiny_model):
    globex_key, _ = await capp.tenant("globex")
    await _upload(capp, globex_key, "globex-secret", tiny_model)
    await sign_in(capp.c, capp.admin_key)
    assert "globex-secret" in (await capp.c.get("/console/adapters")).text
    page = await capp.c.get("/console/adapters/globex/globex-secret")
    assert page.status_code == 200 and "globex-secret@1" in page.text
    token = await csrf_of(capp.c)
    r = await capp.c.post("/console/tenants/globex/status", data={"_csrf": token, "action": "suspend"},
                          follow_redirects=False)
    assert r.status_code == 303
    r = await capp.c.get("/v1/models", headers={"Authorization": f"Bearer {globex_key}"})
    assert r.status_code == 401  # suspension reached the auth cache
    r = await capp.c.post("/console/adapters/globex/globex-secret/delete", data={"_csrf": token},
                          follow_redirects=False)
    assert r.status_code == 303
    assert (await capp.c.get("/console/adapters/globex/globex-secret")).status_code == 404


async def test_script_api_uses_the_sessions_key_with_csrf(capp):
    acme_key, _ = await capp.tenant("acme", scopes=("inference",))
    assert (await capp.c.get("/console/api/v1/models")).status_code == 401
    await sign_in(capp.c, acme_key)
    r = await capp.c.get("/console/api/v1/models")
    assert r.status_code == 200 and r.json()["object"] == "list"
    body = {"model": "nope", "prompt": "hi"}
    r = await capp.c.post("/console/api/v1/completions", json=body)
    assert r.status_code == 403 and r.json()["error"]["code"] == "csrf_failed"
    token = await csrf_of(capp.c)
    r = await capp.c.post("/console/api/v1/completions", json=body, headers={"x-csrf-token": token})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"  # reached the real route
    # the key's own powers only: no admin routes, no adapter writes for an inference key
    assert (await capp.c.get("/console/api/admin/tenants")).status_code == 403
    r = await capp.c.delete("/console/api/v1/adapters/x", headers={"x-csrf-token": token})
    assert r.status_code == 403
    # only platform API paths are forwarded
    for path in ("/console/api/health", "/console/api/console/keys", "/console/api//v1/models",
                 "/console/api/v1/.%2e/admin/keys"):
        assert (await capp.c.get(path)).status_code == 404, path


async def test_usage_and_exports_are_scoped_to_the_tenant(capp):
    await capp.tenant("acme")
    await capp.tenant("globex")
    services = capp.services
    async with services.sessions() as s:
        from loraplex.platform.tenants import get_tenant

        acme, globex = await get_tenant(s, "acme"), await get_tenant(s, "globex")
    for i, (tenant, tokens) in enumerate(((acme, 7), (globex, 1000))):
        await services.usage.record(UsageEvent(
            request_id=f"req-{i}", tenant_id=tenant.id, tenant_name=tenant.name, key_id="k", model="m",
            endpoint="completions", prompt_tokens=tokens, cached_prompt_tokens=0, completion_tokens=tokens,
            status="completed", created_at=utcnow()))
    acme_key, _ = await capp.tenant("acme2")  # a third tenant with no usage at all
    await sign_in(capp.c, acme_key)
    page = await capp.c.get("/console/usage?tenant=globex")
    assert page.status_code == 200 and 'data-testid="total-requests">0<' in page.text
    export = await capp.c.get("/console/usage/export?format=csv&group_by=day&tenant=globex")
    assert export.status_code == 200
    assert list(csv.reader(io.StringIO(export.text)))[1:] == []
    capp.c.cookies.clear()
    await sign_in(capp.c, capp.admin_key)
    page = await capp.c.get("/console/usage?tenant=acme")
    assert 'data-testid="total-requests">1<' in page.text and 'data-testid="total-prompt">7<' in page.text
    rows = list(csv.DictReader(io.StringIO((await capp.c.get("/console/usage/export?group_by=day")).text)))
    assert {r["tenant"]: int(r["total_tokens"]) for r in rows} == {"acme": 14, "globex": 2000}


async def test_pages_carry_security_headers(capp):
    r = await capp.c.get("/console/login")
    csp = r.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp and "unsafe-inline" not in csp
    assert r.headers["x-frame-options"] == "DENY" and r.headers["cache-control"] == "no-store"
    # every asset is served by the app itself
    assert "http" not in r.text.split("<body")[0].replace("http-equiv", "")
    assert (await capp.c.get("/console/static/console.js")).status_code == 200


async def test_a_bad_form_value_returns_to_the_form_with_the_reason(capp):
    await sign_in(capp.c, capp.admin_key)
    token = await csrf_of(capp.c)
    referer = {"referer": "http://testserver.local/console/tenants"}
    r = await capp.c.post("/console/tenants", data={"_csrf": token, "name": "Bad Name!"}, headers=referer,
                          follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/console/tenants"
    page = await capp.c.get("/console/tenants")
    assert "Tenant name must be 1-63 characters" in page.text
    r = await capp.c.post("/console/tenants", data={"_csrf": token, "name": "ok", "requests_per_minute": "lots"},
                          headers=referer)
    assert "Requests / min must be a whole number" in r.text
    assert (await capp.c.get("/console/tenants/ok")).status_code == 404
