"""What a browser user meets beyond the happy path: odd digits in number fields, forms posted after the session
ended, unknown console URLs, and adapters labelled and offered as what they are to this key."""

from __future__ import annotations

import re
from pathlib import Path

from loraplex.platform.console.pages_usage import adapter_label
from tests.conftest import adapter_dir
from tests.unit.console.conftest import csrf_of, sign_in


async def _upload(capp, key: str, name: str, manifest: dict, **fields) -> None:
    d = Path(adapter_dir(manifest, 0))
    files = {"config": ("adapter_config.json", (d / "adapter_config.json").read_bytes()),
             "weights": ("adapter_model.safetensors", (d / "adapter_model.safetensors").read_bytes())}
    r = await capp.c.post("/v1/adapters", data={"name": name, **fields}, files=files,
                          headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 201, r.text


async def test_digits_int_cannot_read_go_back_to_the_form_not_to_a_500(capp):
    await sign_in(capp.c, capp.admin_key)
    token = await csrf_of(capp.c)
    await capp.tenant("acme")
    keys = {"referer": "http://testserver.local/console/keys"}
    r = await capp.c.post("/console/keys", data={"_csrf": token, "tenant": "acme", "scope_inference": "1", "expires_in_days": "²"},
                          headers=keys, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/console/keys", r.text
    assert "Expires in (days) must be a whole number of days" in (await capp.c.get("/console/keys")).text
    tenant_page = {"referer": "http://testserver.local/console/tenants/acme"}
    r = await capp.c.post("/console/tenants/acme/plan", data={"_csrf": token, "monthly_token_quota": "²"},
                          headers=tenant_page, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/console/tenants/acme", r.text
    assert "Monthly token quota must be a whole number" in (await capp.c.get("/console/tenants/acme")).text


async def test_a_form_posted_after_the_session_ended_goes_to_sign_in_not_to_json(capp):
    key, key_id = await capp.tenant("acme")
    await sign_in(capp.c, key)
    token = await csrf_of(capp.c)
    admin = {"Authorization": f"Bearer {capp.admin_key}"}
    assert (await capp.c.delete(f"/admin/keys/{key_id}", headers=admin)).status_code == 200
    r = await capp.c.post("/console/keys", data={"_csrf": token, "name": "late"}, follow_redirects=False,
                          headers={"referer": "http://testserver.local/console/keys"})
    assert r.status_code == 303, r.text
    assert r.headers["location"] == "/console/login?next=/console/keys"
    r = await capp.c.post("/console/logout", data={"_csrf": token}, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"].startswith("/console/login")
    # the page's scripts (they send the CSRF header) still get a 401 they can act on
    r = await capp.c.post("/console/api/v1/completions", json={}, headers={"x-csrf-token": token})
    assert r.status_code == 401 and r.json()["error"]["code"] == "not_signed_in"


async def test_unknown_console_urls_get_the_consoles_own_pages(capp):
    await sign_in(capp.c, capp.admin_key)
    r = await capp.c.get("/console/nope/deeper")
    assert r.status_code == 404 and r.headers["content-type"].startswith("text/html")
    assert "There is no console page at /console/nope/deeper" in r.text
    r = await capp.c.get("/console/logout", follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/console"
    assert (await capp.c.get("/console/static/console.css")).status_code == 200


async def test_adapters_are_offered_and_labelled_as_what_they_are_to_this_key(capp, tiny_model):
    acme_key, _ = await capp.tenant("acme")
    await _upload(capp, acme_key, "secret-sauce", tiny_model)  # private to acme
    await _upload(capp, capp.admin_key, "for-all", tiny_model, visibility="public")
    await sign_in(capp.c, capp.admin_key)
    page = (await capp.c.get("/console/adapters")).text
    assert "/console/playground?model=for-all" in page
    assert "playground?model=acme" not in page  # the operator's key cannot call acme's private adapter
    capp.c.cookies.clear()
    await sign_in(capp.c, acme_key)
    page = (await capp.c.get("/console/adapters")).text
    assert '<span class="tag">public</span>' in page and "shared with you" not in page
    assert "/console/playground?model=admin%2Ffor-all" in page or "/console/playground?model=admin/for-all" in page
    assert 'name="shared_with"' in page  # the upload form can name whom to share with


def test_a_tenants_usage_chart_keeps_another_tenants_adapter_of_the_same_name_apart():
    own = {"adapter_id": "a1", "adapter_name": "globex/adapter-0"}
    theirs = {"adapter_id": "a2", "adapter_name": "admin/adapter-0"}
    assert adapter_label(own, False, "globex") == "adapter-0"
    assert adapter_label(theirs, False, "globex") == "admin/adapter-0"
    assert adapter_label(theirs, True) == "admin/adapter-0"


async def test_resubmitting_the_create_key_form_does_not_make_a_second_key(capp):
    await sign_in(capp.c, capp.admin_key)
    await capp.tenant("acme")
    page = (await capp.c.get("/console/keys")).text
    token = await csrf_of(capp.c)
    form_id = re.search(r'name="form_id" value="([^"]+)"', page).group(1)
    form = {"_csrf": token, "form_id": form_id, "tenant": "acme", "name": "once", "scope_inference": "1"}
    back = {"referer": "http://testserver.local/console/keys"}
    first = await capp.c.post("/console/keys", data=form, headers=back)
    assert first.status_code == 201 and "lpx-" in first.text
    again = await capp.c.post("/console/keys", data=form, headers=back, follow_redirects=False)  # a reload
    assert again.status_code == 303 and again.headers["location"] == "/console/keys"
    assert "already submitted" in (await capp.c.get("/console/keys")).text
    r = await capp.c.get("/admin/keys", params={"tenant": "acme"}, headers={"Authorization": f"Bearer {capp.admin_key}"})
    named = [k for k in r.json()["data"] if k.get("name") == "once"]
    assert len(named) == 1, r.json()
    # a new rendering of the form is a new form
    page = (await capp.c.get("/console/keys")).text
    assert re.search(r'name="form_id" value="([^"]+)"', page).group(1) != form_id
