"""The admin console in headless Chromium against a live ``loraplex serve``: one walk-through
(admin signs in -> creates a tenant, a plan and a key -> the tenant signs in -> uploads an adapter ->
runs it in the playground -> sees it on the usage charts -> exports it) and the isolation check.

Screenshots of every page go to a temporary directory, or to ``LORAPLEX_SCREENSHOT_DIR`` when set
(``LORAPLEX_SCREENSHOT_DIR=docs/console`` refreshes the ones docs/console.md shows): a test run leaves the
tracked files alone. Needs Debian's chromium at /usr/bin/chromium: skipped without it, failed under CI=true.
"""

from __future__ import annotations

import csv
import io
import os
import re
import tempfile
from pathlib import Path

import httpx
import pytest

from tests.conftest import IN_CI, adapter_dir
from tests.e2e.server import KEY_RE, start_server

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SHOTS = Path(os.environ.get("LORAPLEX_SCREENSHOT_DIR") or tempfile.mkdtemp(prefix="loraplex-console-shots-"))
WIDE = {"width": 1280, "height": 800}
NARROW = {"width": 390, "height": 844}


def _require_chromium() -> None:
    if CHROMIUM.exists():
        return
    msg = f"{CHROMIUM} is missing (apt-get install chromium); the console browser tests need it"
    if IN_CI:
        pytest.fail(msg + " (CI=true)")
    pytest.skip(msg)


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model):
    _require_chromium()
    srv = start_server(tmp_path_factory.mktemp("console-srv"), model=tiny_model["model_dir"])
    yield srv
    assert srv.stop() == 0, srv.log_text()[-3000:]


@pytest.fixture(scope="module")
def browser(server, tmp_path_factory):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")), executable_path=str(CHROMIUM), headless=True,
            args=CHROMIUM_ARGS, viewport=WIDE, accept_downloads=True,
        )
        ctx.set_default_timeout(30_000)
        yield ctx
        ctx.close()


@pytest.fixture(scope="module")
def globex(server, tiny_model):
    """Another tenant with a private adapter, made through the API (no browser)."""
    made = server.create_tenant("globex", scopes=["inference", "adapters:write"])
    d = Path(adapter_dir(tiny_model, 1))
    with server.client(made["key"]) as c:
        r = c.post("/v1/adapters", data={"name": "globex-private"}, files={
            "config": ("adapter_config.json", (d / "adapter_config.json").read_bytes()),
            "weights": ("adapter_model.safetensors", (d / "adapter_model.safetensors").read_bytes())})
        assert r.status_code == 201, r.text
    return made


def shot(page, name: str, full_page: bool = True) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=full_page)


def sign_in(page, base: str, key: str) -> None:
    page.context.clear_cookies()  # a fresh browser session
    page.goto(base + "/console/login")
    page.fill("#api_key", key)
    page.click("button[type=submit]")
    page.wait_for_url(base + "/console")


def sign_out(page) -> None:
    page.click("text=Sign out")
    page.wait_for_url("**/console/login")


def test_walk_through(server, browser, globex, tiny_model):
    base = server.base_url
    page = browser.new_page()
    page.on("dialog", lambda d: d.accept())

    # ---- operator ---------------------------------------------------------------------------------
    page.goto(base + "/console")
    assert "/console/login" in page.url
    shot(page, "login", full_page=False)
    sign_in(page, base, server.admin_key)
    cookie = next(c for c in browser.cookies() if c["name"] == "lpx_console")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and not cookie["secure"]
    # the overview refreshes itself: the fragment is replaced without a reload
    page.wait_for_selector("#engine[data-updated]", state="attached")
    assert "running" in page.inner_text("[data-testid=engine-state]")
    assert page.inner_text("[data-testid=num-waiting]").strip().isdigit()
    note = page.inner_text("[data-testid=kv-cache-note]").strip()  # the cache's size and type (the CPU server: float32)
    assert note.startswith("of ") and note.endswith(" blocks, float32"), note
    shot(page, "overview")
    # a form post without the CSRF token (what a cross-site form would send) is refused
    assert page.request.post(base + "/console/tenants", form={"name": "csrf-probe"}).status == 403

    page.click("nav >> text=Tenants")
    page.fill("#pl-name", "standard")
    page.fill("#pl-in", "0.50")
    page.fill("#pl-out", "1.50")
    page.click("[data-testid=create-plan] button[type=submit]")
    page.wait_for_selector("text=Plan 'standard' saved")
    page.fill("#t-name", "acme")
    page.fill("#t-rpm", "120")
    page.click("[data-testid=create-tenant] button[type=submit]")
    page.wait_for_url("**/console/tenants/acme")
    page.select_option("#p-plan", "standard")
    page.fill("#p-quota", "1000000")
    page.click("[data-testid=tenant-plan] button[type=submit]")
    page.wait_for_selector("text=Plan and quota saved")
    page.check("input[name='scope_adapters:write']")
    page.fill("#k-name", "console e2e")
    page.click("[data-testid=create-key] button[type=submit]")
    secret = page.inner_text("[data-testid=new-secret]").strip()
    assert KEY_RE.fullmatch(secret)
    # the published screenshot must not carry a working key
    page.eval_on_selector("[data-testid=new-secret]", "n => n.textContent = n.textContent.slice(0, 17) + '•'.repeat(40)")
    shot(page, "key-created")
    page.goto(base + "/console/tenants/acme")
    assert secret not in page.content()  # shown once only
    shot(page, "tenant")
    page.goto(base + "/console/tenants")
    assert page.locator("[data-testid=tenants] >> text=acme").count() == 1
    shot(page, "tenants")
    page.goto(base + "/console/keys")
    assert secret not in page.content()
    shot(page, "keys")
    sign_out(page)

    # ---- the tenant -------------------------------------------------------------------------------
    sign_in(page, base, secret)
    assert page.inner_text("[data-testid=who]") == "acme"
    assert page.locator("nav >> text=Tenants").count() == 0
    page.click("nav >> text=Adapters")
    d = Path(adapter_dir(tiny_model, 0))
    # a refused upload shows the registry's reason
    page.fill("#up-name", "broken")
    page.click("[data-testid=upload] button[type=submit]")  # no file chosen: told in the form's words
    page.wait_for_selector("[data-testid=upload-note].err-text")
    assert "Choose adapter_config.json and adapter_model.safetensors, or one archive" in \
        page.inner_text("[data-testid=upload-note]")
    page.set_input_files("#up-config", str(d / "adapter_config.json"))
    page.set_input_files("#up-weights", str(d / "adapter_config.json"))
    page.click("[data-testid=upload] button[type=submit]")
    page.wait_for_selector("[data-testid=upload-note].err-text")
    assert "adapter refused" in page.inner_text("[data-testid=upload-note]")
    # the field the refusal is about (the API's error.param) is marked, with the message beside it
    assert page.get_attribute("#up-weights", "aria-invalid") == "true"
    assert page.get_attribute("#up-weights", "aria-describedby") == "up-weights-error"
    assert "adapter refused" in page.inner_text("#up-weights-error")
    assert page.locator("[aria-invalid=true]").count() == 1
    # the progress bar followed the upload to its end before the registry answered
    assert page.is_visible("[data-testid=upload-progress]")
    assert page.eval_on_selector("[data-testid=upload-progress]", "n => n.value") == 100
    page.goto(base + "/console/adapters")
    page.fill("#up-name", "support-bot")
    page.fill("#up-desc", "Replies in the support team's tone")
    page.set_input_files("#up-config", str(d / "adapter_config.json"))
    page.set_input_files("#up-weights", str(d / "adapter_model.safetensors"))
    page.click("[data-testid=upload] button[type=submit]")
    page.wait_for_url("**/console/adapters?uploaded=*")
    row = page.locator("tr[data-adapter=support-bot]")
    assert row.locator("[data-testid=adapter-status]").inner_text() == "ready"
    assert page.locator("tr[data-adapter=broken] [data-testid=adapter-status]").inner_text() == "failed"
    assert "globex" not in page.content()
    shot(page, "adapters")
    page.click("a:text-is('support-bot')")
    page.wait_for_url("**/console/adapters/acme/support-bot")
    shot(page, "adapter")

    page.click("text=Open in playground")
    assert page.input_value("#pg-model") == "support-bot"
    page.fill("#pg-max", "")  # blank is refused, not silently 16
    page.click("#pg-run")
    assert "Max tokens must be a whole number" in page.inner_text("[data-testid=pg-status]")
    assert page.get_attribute("#pg-max", "aria-invalid") == "true"
    assert "Max tokens must be a whole number" in page.inner_text("#pg-max-error")
    page.fill("#pg-max", "24")
    page.click("#pg-run")
    page.wait_for_selector("#pg-usage:not([hidden])")
    assert page.get_attribute("#pg-max", "aria-invalid") is None and page.locator("#pg-max-error").count() == 0
    assert page.inner_text("[data-testid=pg-status]") == "Done"
    assert page.inner_text("#pg-text").strip()
    completion_tokens = int(page.inner_text("[data-testid=pg-completion-tokens]"))
    assert completion_tokens > 0
    shot(page, "playground")

    page.click("nav >> text=Usage")
    bar = page.locator("[data-testid=chart-adapter] g[data-label=support-bot]")
    assert int(bar.get_attribute("data-tokens")) >= completion_tokens
    assert int(page.inner_text("[data-testid=total-requests]")) == 1
    assert page.locator("[data-testid=chart-day] g.day[data-total]:not([data-total='0'])").count() == 1
    shot(page, "usage")
    with page.expect_download() as download:
        page.click("[data-testid=export-csv]")
    rows = list(csv.DictReader(io.StringIO(Path(download.value.path()).read_text())))
    assert [(r["tenant"], int(r["completion_tokens"])) for r in rows] == [("acme", completion_tokens)]

    page.goto(base + "/console")
    page.wait_for_selector("#engine[data-updated]", state="attached")
    assert "globex" not in page.content()
    used = page.inner_text("[data-testid=overview-quota] strong")
    assert used.split("/")[0].strip().replace(",", "") == rows[0]["total_tokens"] and "1,000,000" in used

    # ---- narrow screen ----------------------------------------------------------------------------
    page.set_viewport_size(NARROW)
    for name, path in (("overview", "/console"), ("usage", "/console/usage"), ("playground", "/console/playground")):
        page.goto(base + path)
        shot(page, f"narrow-{name}", full_page=False)
    assert not page.locator("nav >> text=Adapters").is_visible()
    page.click("label.navbtn")  # the sidebar folds into a menu
    assert page.locator("nav >> text=Adapters").is_visible()
    shot(page, "narrow-menu", full_page=False)
    page.set_viewport_size(WIDE)
    page.close()


def test_a_tenant_cannot_open_another_tenants_pages(server, browser, globex):
    base = server.base_url
    made = server.create_tenant("initech", scopes=["inference", "adapters:write"])
    page = browser.new_page()
    sign_in(page, base, made["key"])
    for path, status in (("/console/tenants/globex", 404), ("/console/adapters/globex/globex-private", 404),
                         ("/console/tenants", 403), ("/console/tenants/initech", 200)):
        response = page.goto(base + path)
        assert response.status == status, (path, response.status)
    page.goto(base + "/console/tenants/globex")
    assert "No tenant 'globex'" in page.inner_text("[data-testid=error-message]")
    shot(page, "isolation-404", full_page=False)
    page.goto(base + "/console/adapters")
    assert "globex-private" not in page.content()
    # a scripted call with the session cannot reach admin routes or another tenant's adapter
    token = page.get_attribute("meta[name=csrf-token]", "content")
    assert page.request.get(base + "/console/api/admin/tenants").status == 403
    r = page.request.delete(base + "/console/api/v1/adapters/globex-private", headers={"x-csrf-token": token})
    assert r.status == 404
    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {globex['key']}"}) as c:
        assert c.get("/v1/adapters/globex-private").json()["status"] == "ready"
    # its usage export holds its own rows only, whatever the query asks for
    export = page.request.get(base + "/console/usage/export?format=csv&group_by=day&tenant=acme")
    assert export.status == 200 and "acme" not in export.text()
    page.close()


def _crawl(page, base: str) -> dict[str, int]:
    """Every /console page reachable by links from the overview (sign-out and downloads excluded):
    path -> status. Script errors and failed sub-requests fail the test."""
    from urllib.parse import urljoin, urlparse

    problems: list[str] = []
    page.on("pageerror", lambda exc: problems.append(f"script error on {page.url}: {exc}"))
    page.on("console", lambda m: problems.append(f"console {m.type} on {page.url}: {m.text}")
            if m.type == "error" else None)
    page.on("requestfailed", lambda r: problems.append(f"request failed: {r.url}"))
    seen: dict[str, int] = {}
    queue = ["/console"]
    while queue:
        path = queue.pop(0)
        if path in seen:
            continue
        response = page.goto(base + path)
        page.wait_for_load_state("networkidle")
        seen[path] = response.status
        for href in page.eval_on_selector_all("a[href]", "els => els.map(e => e.getAttribute('href'))"):
            url = urlparse(urljoin(base + path, href))
            target = url.path + (f"?{url.query}" if url.query else "")
            if (url.netloc == urlparse(base).netloc and url.path.startswith("/console")
                    and not url.path.endswith(("/logout", "/export")) and target not in seen):
                queue.append(target)
    assert not problems, problems
    return seen


def test_every_linked_console_page_loads_cleanly(server, browser, globex):
    """Operator and tenant: no broken link, no script error; the tenant's pages never show another
    tenant's private adapter."""
    base = server.base_url
    made = server.create_tenant("hooli", scopes=["inference", "adapters:write"])
    for key, must_see in ((server.admin_key, "/console/tenants/globex"), (made["key"], "/console/keys")):
        page = browser.new_page()
        sign_in(page, base, key)
        seen = _crawl(page, base)
        assert must_see in seen and len(seen) >= 5, seen
        broken = {path: status for path, status in seen.items() if status != 200}
        assert not broken, broken
        if key == made["key"]:
            assert not any("globex" in path for path in seen), seen
        page.close()


def test_server_logs_in_the_same_format_as_every_command(server):
    """One log format for serve and the other commands (loraplex/log.py), not Litestar's second one."""
    line = next(line for line in server.output if "Application startup complete" in line)
    assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO uvicorn\.error: Application startup complete", line), line
