"""Form handling a user review found wanting: re-saving a plan, sharing a private adapter, keys with no
scope, errors named by the form's labels, and one check for every number field."""

from __future__ import annotations

import html

from tests.unit.console.conftest import csrf_of, sign_in
from tests.unit.console.test_console_forms import _upload

TENANTS = {"referer": "http://testserver.local/console/tenants"}


async def _plan(capp, token: str, **fields):
    r = await capp.c.post("/console/plans", data={"_csrf": token, **fields}, headers=TENANTS,
                          follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/console/tenants", r.text
    return html.unescape((await capp.c.get("/console/tenants")).text)


def _row(page: str, name: str) -> list[str]:
    import re

    row = re.search(rf'<td class="strong">{name}</td>(.*?)</tr>', page).group(1)
    return [re.sub(r"<[^>]+>", "", c).strip() for c in row.split("</td>") if c.strip()]


async def test_resaving_a_plan_keeps_what_was_left_blank_and_unlimited_clears_the_quota(capp):
    await sign_in(capp.c, capp.admin_key)
    token = await csrf_of(capp.c, "/console/tenants")
    page = await _plan(capp, token, name="small", currency="usd", input_per_mtok="0.5", cached_input_per_mtok="0.1",
                       output_per_mtok="1.5", monthly_token_quota="100000")
    assert _row(page, "small") == ["0.5 USD", "0.1 USD", "1.5 USD", "100,000"]
    page = await _plan(capp, token, name="small", input_per_mtok="0.7")
    assert "Plan 'small' saved" in page
    assert _row(page, "small") == ["0.7 USD", "0.1 USD", "1.5 USD", "100,000"]
    assert "blank keeps the current value" in page
    page = await _plan(capp, token, name="small", monthly_token_quota="Unlimited")
    assert _row(page, "small") == ["0.7 USD", "0.1 USD", "1.5 USD", "unlimited"]
    page = await _plan(capp, token, name="big")  # a new plan: blank prices are 0, a blank quota unlimited
    assert _row(page, "big") == ["0 USD", "0 USD", "0 USD", "unlimited"]


async def test_errors_name_the_forms_labels_and_number_fields_take_ascii_digits_only(capp):
    await sign_in(capp.c, capp.admin_key)
    token = await csrf_of(capp.c, "/console/tenants")
    page = await _plan(capp, token, name="small", input_per_mtok="-1")
    assert "Input / M tok must be a price between 0 and 1000000" in page and "input_per_mtok must" not in page
    page = await _plan(capp, token, name="small", monthly_token_quota="9" * 30)
    assert "Monthly token quota must be between 0 and 1,000,000,000,000,000" in page
    assert "null" not in page and "monthly_token_quota must" not in page
    r = await capp.c.post("/console/tenants", data={"_csrf": token, "name": "acme", "tokens_per_minute": "9" * 27},
                          headers=TENANTS, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/console/tenants", r.text
    page = html.unescape((await capp.c.get("/console/tenants")).text)
    assert "Tokens / min must be between 1 and 2,147,483,647 (blank = the default)" in page
    r = await capp.c.post("/console/tenants", data={"_csrf": token, "name": "acme", "requests_per_minute": "１２"},
                          headers=TENANTS, follow_redirects=False)
    page = html.unescape((await capp.c.get("/console/tenants")).text)
    assert "Requests / min must be a whole number" in page and "Tenant 'acme' created" not in page


async def test_sharing_a_private_adapter_is_refused_on_the_form_like_the_api_does(capp, tiny_model):
    key, _ = await capp.tenant("acme")
    await _upload(capp, key, "sauce", tiny_model)
    await sign_in(capp.c, key)
    path = "/console/adapters/acme/sauce"
    token = await csrf_of(capp.c, path)
    r = await capp.c.post(f"{path}/settings", data={"_csrf": token, "visibility": "private", "shared_with": "beta"},
                          headers={"referer": f"http://testserver.local{path}"}, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == path, r.text
    page = html.unescape((await capp.c.get(path)).text)
    assert "Shared with names tenants but Visibility is 'private'" in page and "settings saved" not in page


async def test_a_key_with_no_scope_ticked_is_refused_not_made_an_inference_key(capp):
    await capp.tenant("acme")
    await sign_in(capp.c, capp.admin_key)
    token = await csrf_of(capp.c)
    r = await capp.c.post("/console/keys", data={"_csrf": token, "tenant": "acme"}, follow_redirects=False,
                          headers={"referer": "http://testserver.local/console/keys"})
    assert r.status_code == 303 and r.headers["location"] == "/console/keys", r.text
    assert "Scopes: choose at least one scope" in (await capp.c.get("/console/keys")).text
    admin = {"Authorization": f"Bearer {capp.admin_key}"}
    keys = (await capp.c.get("/admin/keys?tenant=acme", headers=admin)).json()
    assert len(keys["data"]) == 1  # only the one capp.tenant made


async def test_the_sign_in_page_says_why_the_session_ended(capp):
    key, key_id = await capp.tenant("acme")
    await sign_in(capp.c, key)
    token = await csrf_of(capp.c)
    r = await capp.c.post(f"/console/keys/{key_id}/revoke", data={"_csrf": token},
                          headers={"referer": "http://testserver.local/console/keys"})  # its own key
    assert str(r.url).startswith("http://testserver.local/console/login"), r.url
    assert f"Key {key_id} revoked" in r.text and "Your API key is no longer valid" in r.text
    assert "Your session has ended" not in r.text
    admin = {"Authorization": f"Bearer {capp.admin_key}"}
    key2, _ = await capp.tenant("beta")
    capp.c.cookies.clear()
    await sign_in(capp.c, key2)
    r = await capp.c.post("/admin/tenants/beta/suspend", headers=admin)
    assert r.status_code == 200, r.text
    r = await capp.c.get("/console/keys")
    assert "Your API key is no longer valid" in r.text and "Your session has ended" not in r.text


async def test_missing_things_are_the_consoles_404_and_refused_posts_go_back_to_the_form(capp):
    key, _ = await capp.tenant("acme")
    await sign_in(capp.c, capp.admin_key)
    r = await capp.c.get("/console/tenants/" + "x" * 70)
    assert r.status_code == 404 and "No tenant" in r.text
    r = await capp.c.get("/console/static/nope.js")
    assert r.status_code == 404 and r.headers["content-type"].startswith("text/html")
    assert "There is no console page at /console/static/nope.js" in r.text
    capp.c.cookies.clear()
    await sign_in(capp.c, key)
    token = await csrf_of(capp.c)
    back = {"referer": "http://testserver.local/console/keys"}
    r = await capp.c.post("/console/tenants/acme/limits", data={"_csrf": token, "requests_per_minute": "5"},
                          headers=back, follow_redirects=False)  # a tenant key: 403
    assert r.status_code == 303 and r.headers["location"] == "/console/keys", r.text
    assert "platform operators" in (await capp.c.get("/console/keys")).text


async def test_a_refused_form_comes_back_filled_in_escaped_and_without_secrets(capp):
    await sign_in(capp.c, capp.admin_key)
    token = await csrf_of(capp.c, "/console/tenants")
    r = await capp.c.post("/console/plans", headers=TENANTS, follow_redirects=False, data={
        "_csrf": token, "name": "p" * 1100, "currency": '"><b>x', "input_per_mtok": "-1", "output_per_mtok": "2.5",
        "monthly_token_quota": "100", "api_key": "lpx-not-for-cookies"})
    assert r.status_code == 303
    assert "lpx-not-for-cookies" not in r.headers["set-cookie"] and token not in r.headers["set-cookie"]
    page = (await capp.c.get("/console/tenants")).text
    assert 'name="input_per_mtok" value="-1" aria-invalid="true" aria-describedby="pl-in-error"' in page
    assert 'name="output_per_mtok" value="2.5"' in page and 'value="&#34;&gt;&lt;b&gt;x"' in page
    assert 'name="name" value="' + "p" * 1024 + '"' in page  # bounded
    assert '<input id="t-name" name="name" value=""' in page  # the other form on the page stays empty
    page = (await capp.c.get("/console/tenants")).text  # shown once
    assert 'value="2.5"' not in page
