"""A tenant's key that expires cannot make, through the console, a key that outlives it (a key lent for a day
would otherwise leave a key that never expires behind)."""

from __future__ import annotations

from datetime import datetime, timezone

from sqlalchemy import select

from loraplex.platform.models import ApiKey
from tests.unit.console.conftest import csrf_of, sign_in

KEY_PAGE = {"referer": "http://testserver.local/console/keys"}


async def _expiring_key(capp, tenant: str, days: int) -> str:
    h = {"Authorization": f"Bearer {capp.admin_key}"}
    assert (await capp.c.post("/admin/tenants", json={"name": tenant}, headers=h)).status_code == 201
    r = await capp.c.post("/admin/keys", json={"tenant": tenant, "scopes": ["inference"],
                                               "expires_in_s": days * 86400}, headers=h)
    assert r.status_code == 201, r.text
    return r.json()["key"]


async def _key(capp, key_id: str) -> ApiKey:
    async with capp.services.sessions() as s:
        return (await s.execute(select(ApiKey).where(ApiKey.id == key_id))).scalar_one()


def _utc(value: datetime) -> datetime:
    return value if value.tzinfo else value.replace(tzinfo=timezone.utc)


async def _create(capp, **fields):
    token = await csrf_of(capp.c)
    return await capp.c.post("/console/keys", data={"_csrf": token, "scope_inference": "1", **fields},
                             headers=KEY_PAGE, follow_redirects=False)


async def test_a_key_made_with_an_expiring_key_expires_no_later(capp):
    lent = await _expiring_key(capp, "acme", 2)
    lent_expiry = _utc((await _key(capp, lent.split("-")[1])).expires_at)
    assert (await sign_in(capp.c, lent)).status_code == 303

    r = await _create(capp, name="forever")  # blank: "never", but not beyond the key that makes it
    assert r.status_code == 201, r.text
    made = await _named(capp, "forever")
    assert made.expires_at is not None and _utc(made.expires_at) <= lent_expiry

    r = await _create(capp, name="later", expires_in_days="30")
    assert r.status_code == 303 and r.headers["location"] == "/console/keys"
    page = (await capp.c.get("/console/keys")).text
    assert "cannot outlive it" in page and "later" not in [k.name for k in await _names(capp)]

    r = await _create(capp, name="sooner", expires_in_days="1")  # within the lent key's life: allowed
    assert r.status_code == 201, r.text


async def _named(capp, name: str) -> ApiKey:
    return next(k for k in await _names(capp) if k.name == name)


async def _names(capp) -> list[ApiKey]:
    async with capp.services.sessions() as s:
        return list((await s.execute(select(ApiKey))).scalars())


async def test_admin_and_non_expiring_keys_are_unchanged(capp):
    key, _ = await capp.tenant("beta", scopes=("inference",))
    assert (await sign_in(capp.c, key)).status_code == 303
    r = await _create(capp, name="forever")
    assert r.status_code == 201, r.text
    made = await _named(capp, "forever")
    assert made.expires_at is None
