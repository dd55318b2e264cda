"""A form refused for a bad value comes back as the user typed it, with the bad field marked and its message
beside it (aria-describedby), the banner still shown, and nothing secret carried in the flash cookie."""

from __future__ import annotations

import base64
import html
import json
import re

from tests.unit.console.conftest import csrf_of, sign_in
from tests.unit.console.test_console_forms import _upload

BASE = "http://testserver.local"


async def _refused(capp, action: str, page: str, data: dict) -> str:
    """Post ``data`` to ``action`` from ``page``; the page it goes back to (shown once)."""
    r = await capp.c.post(action, data=data, headers={"referer": BASE + page}, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == page, r.text
    return (await capp.c.get(page)).text


def _value(page: str, dom_id: str) -> str:
    """The value attribute of the input ``dom_id``."""
    return html.unescape(re.search(rf'<input id="{dom_id}" name="[^"]+" value="([^"]*)"', page).group(1))


def _selected(page: str, dom_id: str) -> list[str]:
    select = re.search(rf'<select id="{dom_id}".*?</select>', page, re.S).group(0)
    return re.findall(r'<option value="([^"]*)" selected>', select)


def _marked(page: str, dom_id: str) -> str:
    """The message next to the field ``dom_id`` (an input, a select or a group of checkboxes), which the field
    names as its description; asserts it is the only field marked and that the banner says it too."""
    assert re.findall(r'aria-describedby="([^"]+)"', page) == [f"{dom_id}-error"], page
    field = re.search(rf'<(input|select|fieldset) id="{dom_id}"[^>]*>', page).group(0)
    group = field.startswith("<fieldset")  # a group has no aria-invalid: its message says what is wrong
    assert f'aria-describedby="{dom_id}-error"' in field and ('aria-invalid="true"' in field) != group
    assert page.count('aria-invalid="true"') == (0 if group else 1)
    found = re.search(rf'<p id="{dom_id}-error" class="field-error">(.*?)</p>', page, re.S)
    assert found, page
    message = html.unescape(found.group(1))
    assert (
        html.unescape(re.search(r'<div class="notice err" role="alert">(.*?)</div>', page).group(1))
        == message
    )
    return message


async def test_the_create_tenant_and_plan_forms_say_what_is_wrong_beside_the_field(capp):
    await sign_in(capp.c, capp.admin_key)
    token = await csrf_of(capp.c, "/console/tenants")
    page = await _refused(
        capp,
        "/console/tenants",
        "/console/tenants",
        {"_csrf": token, "name": "acme", "requests_per_minute": "60", "tokens_per_minute": "lots"},
    )
    assert _marked(page, "t-tpm").startswith("Tokens / min must be a whole number")
    # a count of tokens is no secret token: it comes back too
    assert (_value(page, "t-name"), _value(page, "t-rpm"), _value(page, "t-tpm")) == ("acme", "60", "lots")
    assert _value(page, "pl-name") == ""  # the other form on the page
    page = await _refused(
        capp,
        "/console/plans",
        "/console/tenants",
        {"_csrf": token, "name": "Gold!", "input_per_mtok": "0.5", "monthly_token_quota": "1000"},
    )
    assert _marked(page, "pl-name").startswith("name must be 1-64 characters")
    assert (_value(page, "pl-name"), _value(page, "pl-in"), _value(page, "pl-quota")) == (
        "Gold!",
        "0.5",
        "1000",
    )
    assert _value(page, "t-name") == ""
    page = await _refused(
        capp,
        "/console/plans",
        "/console/tenants",
        {"_csrf": token, "name": "gold", "monthly_token_quota": "lots"},
    )
    assert _marked(page, "pl-quota").startswith("Monthly token quota must be a whole number")
    assert _value(page, "pl-quota") == "lots"


async def test_the_rate_limits_form_comes_back_as_typed_with_the_bad_field_marked(capp):
    await capp.tenant("acme")
    await sign_in(capp.c, capp.admin_key)
    path = "/console/tenants/acme"
    token = await csrf_of(capp.c, path)
    page = await _refused(
        capp,
        f"{path}/limits",
        path,
        {"_csrf": token, "requests_per_minute": "120", "tokens_per_minute": "9" * 20},
    )
    assert _marked(page, "l-tpm") == "Tokens / min must be between 1 and 2,147,483,647 (blank = the default)."
    assert (_value(page, "l-rpm"), _value(page, "l-tpm")) == ("120", "9" * 20)
    assert _value(page, "p-quota") == "" and _value(page, "k-name") == ""  # the page's other forms
    page = (await capp.c.get(path)).text  # once: then the saved values again
    assert (_value(page, "l-rpm"), _value(page, "l-tpm")) == ("", "")
    assert "field-error" not in page and "aria-invalid" not in page


async def test_the_tenant_plan_form_comes_back_with_its_plan_chosen_and_the_quota_marked(capp):
    await capp.tenant("acme")
    await sign_in(capp.c, capp.admin_key)
    token = await csrf_of(capp.c, "/console/tenants")
    for name in ("gold", "silver"):
        r = await capp.c.post(
            "/console/plans",
            data={"_csrf": token, "name": name},
            follow_redirects=False,
            headers={"referer": BASE + "/console/tenants"},
        )
        assert r.status_code == 303, r.text
    path = "/console/tenants/acme"
    page = await _refused(
        capp, f"{path}/plan", path, {"_csrf": token, "plan": "silver", "monthly_token_quota": "-5"}
    )
    assert _marked(page, "p-quota").startswith("Monthly token quota must be a whole number of tokens")
    assert _value(page, "p-quota") == "-5" and _selected(page, "p-plan") == ["silver"]
    page = await _refused(capp, f"{path}/plan", path, {"_csrf": token, "plan": "bronze"})
    assert _marked(page, "p-plan") == "No plan 'bronze'."


async def test_the_key_form_comes_back_with_tenant_label_scopes_and_expiry_as_typed(capp):
    await capp.tenant("acme")
    await capp.tenant("beta")
    await sign_in(capp.c, capp.admin_key)
    token = await csrf_of(capp.c)
    page = await _refused(
        capp,
        "/console/keys",
        "/console/keys",
        {
            "_csrf": token,
            "form_id": "f1",
            "tenant": "beta",
            "name": "ci <bot>",
            "scope_adapters:write": "1",
            "expires_in_days": "forever",
        },
    )
    assert _marked(page, "k-exp").startswith("Expires in (days) must be a whole number of days")
    assert (_value(page, "k-name"), _value(page, "k-exp")) == ("ci <bot>", "forever")
    assert 'value="ci &lt;bot&gt;"' in page  # escaped
    assert _selected(page, "k-tenant") == ["beta"]
    assert re.findall(r'name="scope_([^"]+)" value="1" checked', page) == [
        "adapters:write"
    ]  # inference unticked
    page = await _refused(
        capp, "/console/keys", "/console/keys", {"_csrf": token, "tenant": "acme", "name": "no scopes"}
    )
    assert _marked(page, "k-scopes") == "Scopes: choose at least one scope."
    assert re.findall(r'name="scope_([^"]+)" value="1" checked', page) == []
    # the same form on a tenant's page goes back there, filled in
    path = "/console/tenants/acme"
    page = await _refused(
        capp,
        "/console/keys",
        path,
        {"_csrf": token, "tenant": "acme", "name": "x" * 129, "scope_inference": "1"},
    )
    assert _marked(page, "k-name") == "name must be at most 128 printable characters."
    assert _value(page, "k-name") == "x" * 129


async def test_the_adapter_settings_form_comes_back_as_typed_with_the_bad_field_marked(capp, tiny_model):
    key, _ = await capp.tenant("acme")
    await _upload(capp, key, "sauce", tiny_model, description="saved text")
    await sign_in(capp.c, key)
    path = "/console/adapters/acme/sauce"
    token = await csrf_of(capp.c, path)
    typed = 'the "new" <text>'
    page = await _refused(
        capp,
        f"{path}/settings",
        path,
        {"_csrf": token, "visibility": "shared", "shared_with": "beta, Not A Name", "description": typed},
    )
    assert _marked(page, "s-share").startswith("shared_with: 'Not A Name' cannot be a tenant name")
    assert (_value(page, "s-share"), _value(page, "s-desc")) == ("beta, Not A Name", typed)
    assert "&lt;text&gt;" in page and "<text>" not in page
    assert _selected(page, "s-vis") == ["shared"]
    page = await _refused(
        capp,
        f"{path}/settings",
        path,
        {"_csrf": token, "visibility": "private", "shared_with": "beta", "description": "d"},
    )
    assert _marked(page, "s-share").startswith("Shared with names tenants but Visibility is 'private'")
    assert _selected(page, "s-vis") == ["private"] and _value(page, "s-desc") == "d"
    page = (await capp.c.get(path)).text  # once: the saved settings again
    assert _value(page, "s-desc") == "saved text" and _selected(page, "s-vis") == ["private"]


async def test_the_flash_cookie_carries_no_secret_and_stays_under_4kb(capp, tiny_model):
    key, _ = await capp.tenant("acme")
    await _upload(capp, key, "sauce", tiny_model)
    await sign_in(capp.c, capp.admin_key)
    token = await csrf_of(capp.c)
    r = await capp.c.post(
        "/console/keys",
        follow_redirects=False,
        headers={"referer": BASE + "/console/keys"},
        data={
            "_csrf": token,
            "form_id": "fid-123",
            "tenant": "acme",
            "expires_in_days": "x",
            "api_key": "lpx-secret",
            "password": "pw",
            "scope_inference": "1",
        },
    )
    cookie = re.search(r"lpx_console_flash=([^;]+)", r.headers["set-cookie"]).group(1)
    carried = json.loads(base64.urlsafe_b64decode(cookie.strip('"')))
    assert carried["f"] == {"tenant": "acme", "expires_in_days": "x", "scope_inference": "1"}
    assert carried["p"] == "expires_in_days" and carried["a"] == "/console/keys"
    await capp.c.get("/console/keys")
    # a description as long as the form takes, in three-byte characters: the cookie would pass 4 KB, so that
    # field stays behind (the form shows the saved text) rather than being cut short; the rest comes back
    path = "/console/adapters/acme/sauce"
    r = await capp.c.post(
        f"{path}/settings",
        follow_redirects=False,
        headers={"referer": BASE + path},
        data={"_csrf": token, "visibility": "private", "shared_with": "beta", "description": "€" * 1024},
    )
    assert r.status_code == 303 and len(r.headers["set-cookie"]) < 4096
    page = (await capp.c.get(path)).text
    assert _value(page, "s-share") == "beta" and _value(page, "s-desc") == ""
    assert _marked(page, "s-share").startswith("Shared with names tenants")
