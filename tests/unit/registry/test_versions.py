"""Versions, content addressing, concurrent uploads and soft delete."""

from __future__ import annotations

import asyncio
from pathlib import Path

from loraplex.platform.auth import Principal
from tests.unit.registry.conftest import adapter_files, tar_gz


async def _resolve(rapp, key_tenant: str, model: str):
    async with rapp.services.sessions() as s:
        from sqlalchemy import select

        from loraplex.platform.models import Tenant

        tenant = (await s.execute(select(Tenant).where(Tenant.name == key_tenant))).scalars().one()
    principal = Principal(tenant_id=tenant.id, tenant_name=tenant.name, key_id="k", scopes=frozenset())
    return await rapp.services.models.resolve(principal, model)


async def test_versions_names_and_content_addressing(rapp, tiny_model):
    c0, w0 = adapter_files(tiny_model, 0)
    c1, w1 = adapter_files(tiny_model, 1)
    r1 = await rapp.upload(None, "tone", config=c0, weights=w0)
    # the same content again, as an archive in a directory: a new version, stored once
    r2 = await rapp.upload(None, "tone", archive=tar_gz({"tone/adapter_config.json": c0,
                                                          "tone/adapter_model.safetensors": w0,
                                                          "tone/README.md": b"hello"}))
    r3 = await rapp.upload(None, "tone", config=c1, weights=w1)
    assert [r.status_code for r in (r1, r2, r3)] == [201, 201, 201], r2.text
    assert [r.json()["version"] for r in (r1, r2, r3)] == [1, 2, 3]
    v = {x["version"]: x for x in r3.json()["versions"]}
    assert v[1]["sha256"] == v[2]["sha256"] != v[3]["sha256"]
    assert len(rapp.store_digests()) == 2

    latest, pinned = await _resolve(rapp, "admin", "tone"), await _resolve(rapp, "admin", "tone@1")
    assert latest.adapter_version == 3 and pinned.adapter_version == 1
    ids = {latest.lora_request.lora_int_id, pinned.lora_request.lora_int_id}
    assert len(ids) == 2 and min(ids) >= 1
    store = (rapp.data_dir / "adapters" / "store").resolve()
    assert Path(latest.lora_request.lora_path).resolve().is_relative_to(store)
    assert (Path(pinned.lora_request.lora_path) / "adapter_model.safetensors").read_bytes() == w0
    assert await _resolve(rapp, "admin", "tone@9") is None

    # delete one version: the name falls back to the newest remaining one
    assert (await rapp.client.delete("/v1/adapters/tone@3", headers=rapp.headers())).status_code == 200
    assert (await _resolve(rapp, "admin", "tone")).adapter_version == 2
    # delete the adapter: gone at once; uploading the name again continues the numbering
    assert (await rapp.client.delete("/v1/adapters/tone", headers=rapp.headers())).status_code == 200
    assert await _resolve(rapp, "admin", "tone") is None
    assert await _resolve(rapp, "admin", "tone@2") is None
    assert (await rapp.client.get("/v1/adapters/tone", headers=rapp.headers())).status_code == 404
    r4 = await rapp.upload(None, "tone", config=c1, weights=w1)
    assert r4.status_code == 201 and r4.json()["version"] == 4
    assert [x["version"] for x in r4.json()["versions"]] == [4]
    assert (await _resolve(rapp, "admin", "tone")).adapter_version == 4
    # deleting the last live version deletes the adapter
    assert (await rapp.client.delete("/v1/adapters/tone@4", headers=rapp.headers())).status_code == 200
    assert (await rapp.client.get("/v1/adapters/tone", headers=rapp.headers())).status_code == 404


async def test_getting_one_version_keeps_the_adapters_own_fields(rapp, tiny_model):
    """``GET name@N`` narrows ``versions`` to N; status and latest_version stay the adapter's (a failed version 2
    of a ready adapter showed the adapter as failed, with no latest version)."""
    import torch
    from safetensors.torch import load, save

    c0, w0 = adapter_files(tiny_model, 0)
    assert (await rapp.upload(None, "tone", config=c0, weights=w0)).status_code == 201
    tensors = load(w0)
    first = next(iter(tensors))
    tensors[first] = torch.full_like(tensors[first], float("nan"))
    assert (await rapp.upload(None, "tone", config=c0, weights=save(tensors))).status_code == 422
    r = await rapp.client.get("/v1/adapters/tone@2", headers=rapp.headers())
    assert r.status_code == 200, r.text
    got = r.json()
    assert (got["status"], got["latest_version"], got["version"]) == ("ready", 1, 2)
    assert [(v["version"], v["status"]) for v in got["versions"]] == [(2, "failed")]
    got = (await rapp.client.get("/v1/adapters/tone@1", headers=rapp.headers())).json()
    assert (got["status"], got["latest_version"], got["version"]) == ("ready", 1, 1)
    assert [v["version"] for v in got["versions"]] == [1]
    assert (await rapp.client.get("/v1/adapters/tone@3", headers=rapp.headers())).status_code == 404


async def test_editing_one_version_is_a_400_pointing_at_the_name(rapp, tiny_model):
    """Versions are immutable: ``PATCH name@N`` names the path parameter and says what to edit instead; it
    answers the same whether or not the adapter exists (the path alone decides)."""
    c0, w0 = adapter_files(tiny_model, 0)
    assert (await rapp.upload(None, "tone", config=c0, weights=w0)).status_code == 201
    for path in ("tone@1", "tone@7", "nothing-here@1"):
        r = await rapp.client.patch(f"/v1/adapters/{path}", json={"description": "x"}, headers=rapp.headers())
        assert r.status_code == 400, (path, r.text)
        err = r.json()["error"]
        assert err["param"] == "name" and err["code"] == "invalid_value", err
        name = path.split("@")[0]
        assert "immutable" in err["message"] and f"PATCH /v1/adapters/{name}" in err["message"], err
    r = await rapp.client.get("/v1/adapters/tone", headers=rapp.headers())
    assert r.json()["description"] is None  # nothing changed
    r = await rapp.client.patch("/v1/adapters/tone", json={"description": "x"}, headers=rapp.headers())
    assert r.status_code == 200 and r.json()["description"] == "x"


async def test_concurrent_uploads_of_one_name_never_corrupt(rapp, tiny_model):
    uploads = [adapter_files(tiny_model, i % 3) for i in range(5)]
    results = await asyncio.gather(*[rapp.upload(None, "race", config=c, weights=w) for c, w in uploads])
    codes = [r.status_code for r in results]
    assert set(codes) <= {201, 409}, [r.text for r in results]
    created = sorted(r.json()["version"] for r in results if r.status_code == 201)
    assert len(created) == len(set(created)) >= 1  # distinct versions
    for r in results:
        if r.status_code == 409:
            assert r.json()["error"]["code"] == "conflict"
    got = (await rapp.client.get("/v1/adapters/race", headers=rapp.headers())).json()
    assert sorted(v["version"] for v in got["versions"]) == created
    assert all(v["status"] == "ready" and v["sha256"] for v in got["versions"])
    assert got["latest_version"] == max(created)
    assert rapp.tmp_entries() == []


async def test_deleted_content_is_collected_after_the_grace_period(rapp, tiny_model):
    from loraplex.platform.registry.cleanup import collect_garbage

    registry = rapp.services.extras["registry"]
    c0, w0 = adapter_files(tiny_model, 0)
    c1, w1 = adapter_files(tiny_model, 1)
    for name, c, w in (("keep", c0, w0), ("twin", c0, w0), ("drop", c1, w1)):
        assert (await rapp.upload(None, name, config=c, weights=w)).status_code == 201
    assert len(rapp.store_digests()) == 2
    for name in ("twin", "drop"):
        assert (await rapp.client.delete(f"/v1/adapters/{name}", headers=rapp.headers())).status_code == 200
    sessions, store = rapp.services.sessions, registry.store
    assert await collect_garbage(sessions, store, grace_s=3600) == 0  # recently deleted: kept for in-flight use
    assert await collect_garbage(sessions, store, grace_s=0) == 1  # "twin" shares content with live "keep"
    assert len(rapp.store_digests()) == 1
    r = await rapp.client.get("/v1/adapters/keep", headers=rapp.headers())
    assert r.json()["status"] == "ready"
    # uploading the collected content again stores it again
    assert (await rapp.upload(None, "drop", config=c1, weights=w1)).status_code == 201
    assert len(rapp.store_digests()) == 2
