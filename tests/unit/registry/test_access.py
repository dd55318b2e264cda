"""Tenancy: another tenant can neither list, use, modify nor delete a private adapter (404, exactly like a
missing one), can use one shared with it, and cannot make one public. (SECURITY.md items 1-2.)"""

from __future__ import annotations

import json

from tests.unit.registry.conftest import adapter_files


async def _names(rapp, key) -> set[str]:
    r = await rapp.client.get("/v1/adapters", headers=rapp.headers(key))
    assert r.status_code == 200
    return {a["model"] for a in r.json()["data"]}


async def _call(rapp, key, model: str):
    """A chat completion: this app runs no engine, so 503 means "resolved, usable", 404 "no such model"."""
    return await rapp.client.post("/v1/chat/completions", headers=rapp.headers(key), json={
        "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})


async def _models(rapp, key) -> set[str]:
    r = await rapp.client.get("/v1/models", headers=rapp.headers(key))
    return {m["id"] for m in r.json()["data"]}


async def test_private_adapter_is_invisible_to_other_tenants(rapp, tiny_model):
    alice, bob = await rapp.tenant("alice"), await rapp.tenant("bob")
    config, weights = adapter_files(tiny_model, 1)
    r = await rapp.upload(alice, "secret", config=config, weights=weights, description="alice's")
    assert r.status_code == 201, r.text
    assert r.json()["visibility"] == "private" and r.json()["owner"] == "alice"

    assert "secret" in await _names(rapp, alice) and "secret" in await _models(rapp, alice)
    assert await _names(rapp, bob) == set()
    assert not any("secret" in m for m in await _models(rapp, bob))
    hb = rapp.headers(bob)
    assert (await _call(rapp, alice, "secret")).status_code == 503  # resolves for its owner
    assert (await _call(rapp, alice, "alice/secret@1")).status_code == 503
    for model in ("alice/secret", "alice/secret@1", "secret"):
        r = await _call(rapp, bob, model)
        missing = await _call(rapp, bob, model.replace("secret", "nothing"))
        assert r.status_code == missing.status_code == 404
        assert r.json()["error"]["code"] == "model_not_found"
        assert r.json()["error"]["message"].replace("secret", "X") == \
            missing.json()["error"]["message"].replace("nothing", "X")
    # Bob's own namespace: GET/PATCH/DELETE of the same name are plain 404s, and Alice's adapter is untouched
    for method, kw in (("GET", {}), ("PATCH", {"json": {"description": "pwned"}}), ("DELETE", {})):
        r = await rapp.client.request(method, "/v1/adapters/secret", headers=hb, **kw)
        other = await rapp.client.request(method, "/v1/adapters/nothing", headers=hb, **kw)
        assert r.status_code == other.status_code == 404, (method, r.text)
    r = await rapp.client.get("/v1/adapters/secret", headers=rapp.headers(alice))
    assert r.status_code == 200 and r.json()["description"] == "alice's" and r.json()["status"] == "ready"


async def test_sharing_grants_use_but_not_control(rapp, tiny_model):
    alice, bob, carol = await rapp.tenant("alice"), await rapp.tenant("bob"), await rapp.tenant("carol")
    config, weights = adapter_files(tiny_model, 1)
    assert (await rapp.upload(alice, "tuned", config=config, weights=weights)).status_code == 201
    r = await rapp.client.patch("/v1/adapters/tuned", json={"shared_with": ["bob"]}, headers=rapp.headers(alice))
    assert r.status_code == 200 and r.json()["visibility"] == "shared" and r.json()["shared_with"] == ["bob"]

    assert (await _call(rapp, bob, "alice/tuned")).status_code == 503
    assert (await _call(rapp, bob, "tuned")).status_code == 404  # a bare name is always the caller's own
    assert "alice/tuned" in await _models(rapp, bob) and "alice/tuned" in await _names(rapp, bob)
    listed = (await rapp.client.get("/v1/adapters", headers=rapp.headers(bob))).json()["data"][0]
    assert listed["shared_with"] is None  # who else it is shared with is the owner's business
    assert (await _call(rapp, carol, "alice/tuned")).status_code == 404
    r = await rapp.client.get("/v1/models/alice/tuned", headers=rapp.headers(bob))
    assert r.status_code == 200 and r.json()["id"] == "alice/tuned" and r.json()["owned_by"] == "alice"
    assert (await rapp.client.get("/v1/models/alice/tuned", headers=rapp.headers(carol))).status_code == 404
    # a sharee still cannot edit or delete it
    assert (await rapp.client.delete("/v1/adapters/tuned", headers=rapp.headers(bob))).status_code == 404
    # unsharing takes effect at once (cached lookups are invalidated)
    r = await rapp.client.patch("/v1/adapters/tuned", json={"visibility": "private", "shared_with": []},
                                headers=rapp.headers(alice))
    assert r.status_code == 200
    assert (await _call(rapp, bob, "alice/tuned")).status_code == 404


async def test_private_with_a_share_list_is_a_400_not_a_share_that_shares_nothing(rapp, tiny_model):
    """``visibility: private`` with tenants in ``shared_with`` was stored and echoed back as if shared, while the
    tenants named got a 404: the owner was told it shared when it did not."""
    alice, bob = await rapp.tenant("alice"), await rapp.tenant("bob")
    config, weights = adapter_files(tiny_model, 1)
    r = await rapp.upload(alice, "tuned", config=config, weights=weights, visibility="private", shared_with="bob")
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "shared_with" and "private" in err["message"] and "'shared'" in err["message"]
    assert (await rapp.client.get("/v1/adapters/tuned", headers=rapp.headers(alice))).status_code == 404
    assert (await rapp.upload(alice, "tuned", config=config, weights=weights)).status_code == 201
    r = await rapp.client.patch("/v1/adapters/tuned", json={"visibility": "private", "shared_with": ["bob"]},
                                headers=rapp.headers(alice))
    assert r.status_code == 400 and r.json()["error"]["param"] == "shared_with", r.text
    got = (await rapp.client.get("/v1/adapters/tuned", headers=rapp.headers(alice))).json()
    assert got["visibility"] == "private" and got["shared_with"] == []  # nothing changed
    assert (await _call(rapp, bob, "alice/tuned")).status_code == 404


async def test_only_admins_make_adapters_public(rapp, tiny_model):
    alice, bob = await rapp.tenant("alice"), await rapp.tenant("bob")
    config, weights = adapter_files(tiny_model, 2)
    r = await rapp.upload(alice, "mine", config=config, weights=weights, visibility="public")
    assert r.status_code == 403 and "admin" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "visibility"  # names the field to change
    assert rapp.store_digests() == set()
    assert (await rapp.upload(alice, "mine", config=config, weights=weights)).status_code == 201
    r = await rapp.client.patch("/v1/adapters/mine", json={"visibility": "public"}, headers=rapp.headers(alice))
    assert r.status_code == 403 and r.json()["error"]["param"] == "visibility"
    assert (await _call(rapp, bob, "alice/mine")).status_code == 404
    # the operator publishes its own adapter; every tenant may then call it as admin/<name>
    assert (await rapp.upload(None, "house", config=config, weights=weights, visibility="public")).status_code == 201
    assert (await _call(rapp, bob, "admin/house")).status_code == 503
    assert "admin/house" in await _models(rapp, alice)


async def test_keys_without_the_write_scope_cannot_upload(rapp, tiny_model):
    reader = await rapp.tenant("reader", scopes=("inference",))
    config, weights = adapter_files(tiny_model, 0)
    r = await rapp.upload(reader, "x", config=config, weights=weights)
    assert r.status_code == 403
    assert (await rapp.client.get("/v1/adapters", headers={"Authorization": "Bearer nope"})).status_code == 401
    assert rapp.store_digests() == set()


async def test_sharing_does_not_reveal_which_tenants_exist(rapp, tiny_model):
    """``shared_with`` answers the same whether a named tenant exists or not (SECURITY.md: A must not learn
    about B); a name that does not exist yet simply shares nothing until a tenant of that name is created."""
    alice, bob = await rapp.tenant("alice"), await rapp.tenant("bob")
    config, weights = adapter_files(tiny_model, 1)
    assert (await rapp.upload(alice, "tuned", config=config, weights=weights)).status_code == 201

    async def share(names):
        r = await rapp.client.patch("/v1/adapters/tuned", json={"shared_with": names}, headers=rapp.headers(alice))
        body = r.json()
        body.pop("updated_at", None)
        return r.status_code, json.dumps(body).replace(names[0], "NAME")

    assert await share(["bob"]) == await share(["nobody-here"])  # an existing and an unknown name: one answer
    status, body = await share(["nobody-here"])
    assert status == 200 and json.loads(body)["shared_with"] == ["NAME"]
    r = await rapp.upload(alice, "other", config=config, weights=weights, shared_with="ghost,bob")
    assert r.status_code == 201 and r.json()["shared_with"] == ["bob", "ghost"]
    assert (await _call(rapp, bob, "alice/other")).status_code == 503  # bob, who exists, got it
    # a malformed name is refused for its spelling alone (no tenant could ever have it)
    r = await rapp.client.patch("/v1/adapters/tuned", json={"shared_with": ["Not A Name"]}, headers=rapp.headers(alice))
    assert r.status_code == 400 and r.json()["error"]["param"] == "shared_with"
    assert "unknown" not in r.json()["error"]["message"]

    # the share by name takes effect once the tenant exists, and unsharing ends it
    assert (await _call(rapp, bob, "alice/tuned")).status_code == 404
    later = await rapp.tenant("nobody-here")
    assert (await _call(rapp, later, "alice/tuned")).status_code == 503
    assert "alice/tuned" in await _models(rapp, later)
    r = await rapp.client.patch("/v1/adapters/tuned", json={"shared_with": []}, headers=rapp.headers(alice))
    assert r.status_code == 200 and r.json()["shared_with"] == []
    assert (await _call(rapp, later, "alice/tuned")).status_code == 404
