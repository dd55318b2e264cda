"""Every dangerous or broken upload is refused with a 4xx naming the problem; nothing is stored, no temporary
file is left, and the name does not resolve. (SECURITY.md items 8-13.)"""

from __future__ import annotations

import gzip
import io
import json
import os
import tarfile
import zipfile

import pytest
import torch
from safetensors.torch import load, save

from loraplex.platform.errors import ApiError
from tests.unit.registry.conftest import UPLOAD_LIMIT, adapter_files, config_with, tar_gz


def _tensors(weights: bytes) -> dict[str, torch.Tensor]:
    return load(weights)


def _nan(c, w):
    t = _tensors(w)
    name = sorted(t)[3]
    t[name] = t[name].clone()
    t[name][0, 0] = float("nan")
    return {"config": c, "weights": save(t)}


def _inf(c, w):
    t = _tensors(w)
    name = sorted(t)[-1]
    t[name] = t[name].clone()
    t[name][-1, -1] = float("inf")
    return {"config": c, "weights": save(t)}


def _wrong_shape(c, w):
    t = _tensors(w)
    name = next(n for n in sorted(t) if "lora_A" in n)
    t[name] = torch.randn(t[name].shape[0], t[name].shape[1] + 8)
    return {"config": c, "weights": save(t)}


def _float64(c, w):
    return {"config": c, "weights": save({k: v.double() for k, v in _tensors(w).items()})}


def _header_100mb(c, w):
    return {"config": c, "weights": (100 * 1024 * 1024).to_bytes(8, "little") + b'{"a":' + b" " * 64}


def _header_200k(c, w):
    entry = '"t{}":{{"dtype":"F32","shape":[0],"data_offsets":[0,0]}}'
    header = ("{" + ",".join(entry.format(i) for i in range(200_000)) + "}").encode()
    return {"config": c, "weights": len(header).to_bytes(8, "little") + header}


def _pickle_bin(c, w):
    import pickle

    return {"config": c, "weights": pickle.dumps({"x": 1}), "weights_filename": "adapter_model.bin"}


def _pickle_in_archive(c, w):
    return {"archive": tar_gz({"adapter_config.json": c, "adapter_model.bin": b"\x80\x04K\x01."})}


def _dotdot(c, w):
    return {"archive": tar_gz({"../adapter_config.json": c, "adapter_model.safetensors": w})}


def _absolute(c, w):
    return {"archive": tar_gz({"/tmp/adapter_config.json": c, "adapter_model.safetensors": w})}


def _symlink(c, w):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        info = tarfile.TarInfo("adapter_config.json")
        info.size = len(c)
        tar.addfile(info, io.BytesIO(c))
        link = tarfile.TarInfo("adapter_model.safetensors")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(link)
    return {"archive": buf.getvalue()}


def _zip_dotdot(c, w):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("adapter_config.json", c)
        zf.writestr("x/../../adapter_model.safetensors", w)
    return {"archive": buf.getvalue()}


def _zip_symlink(c, w):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("adapter_config.json", c)
        info = zipfile.ZipInfo("adapter_model.safetensors")
        info.external_attr = (0o120777 << 16)
        zf.writestr(info, "/etc/passwd")
    return {"archive": buf.getvalue()}


def _zip_encrypted(c, w):
    # what `zip -e` writes: the encryption bit set on each member (zipfile can only refuse to read it)
    raw = bytearray(_zipped({"adapter_config.json": c, "adapter_model.safetensors": w}))
    for signature, flags_at in ((b"PK\x03\x04", 6), (b"PK\x01\x02", 8)):
        at = raw.find(signature)
        while at >= 0:
            raw[at + flags_at] |= 1
            at = raw.find(signature, at + 4)
    return {"archive": bytes(raw)}


def _zip_lzma_damaged(c, w):
    raw = bytearray(_zipped({"adapter_config.json": c, "adapter_model.safetensors": w}, zipfile.ZIP_LZMA))
    middle = len(raw) // 2
    raw[middle:middle + 64] = bytes(b ^ 0x5A for b in raw[middle:middle + 64])
    return {"archive": bytes(raw)}


def _tar_gz_bad_checksum(c, w):
    # bytes that inflate to a valid tar, under a gzip CRC that does not match them
    raw = bytearray(tar_gz({"adapter_config.json": c, "adapter_model.safetensors": w}))
    raw[-8:-4] = bytes(b ^ 0xFF for b in raw[-8:-4])
    return {"archive": bytes(raw)}


def _zipped(members: dict[str, bytes], compression: int = zipfile.ZIP_STORED) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=compression) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return buf.getvalue()


def _tar_bomb(c, w):
    # five members of 8 MB of zeros: each under the cap, together over it; compresses to ~40 KB
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for i in range(5):
            info = tarfile.TarInfo(f"pad-{i}.txt")
            info.size = 8 << 20
            tar.addfile(info, io.BytesIO(bytes(info.size)))
    return {"archive": gzip.compress(buf.getvalue(), compresslevel=1)}


def _zip_bomb(c, w):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("adapter_config.json", c)
        zf.writestr("adapter_model.safetensors", b"\0" * (40 << 20))
    return {"archive": buf.getvalue()}


def _too_big(c, w):
    return {"config": c, "weights": os.urandom(UPLOAD_LIMIT + 1024)}


CASES = {
    "pickle adapter_model.bin": (_pickle_bin, 422, "pickle"),
    "pickle inside an archive": (_pickle_in_archive, 422, "pickle"),
    "pickle sent as the safetensors weights": (lambda c, w: {"config": c, "weights": _pickle_bin(c, w)["weights"]}, 422,
                                               "not a safetensors file: it is a Python pickle"),
    "archive member with ..": (_dotdot, 422, ".."),
    "archive member with an absolute path": (_absolute, 422, "absolute"),
    "archive symlink": (_symlink, 422, "link"),
    "zip member with ..": (_zip_dotdot, 422, ".."),
    "zip symlink": (_zip_symlink, 422, "link"),
    "encrypted zip": (_zip_encrypted, 422, "is encrypted"),
    "zip with damaged LZMA data": (_zip_lzma_damaged, 422, "not a valid .zip"),
    ".tar.gz whose gzip checksum fails": (_tar_gz_bad_checksum, 422, "CRC check failed"),
    "tar.gz bomb": (_tar_bomb, 413, "limit"),
    "zip bomb": (_zip_bomb, 413, "limit"),
    "safetensors header claiming 100 MB": (_header_100mb, 422, "header claims"),
    "safetensors header with 200,000 tensors": (_header_200k, 422, "over the cap"),
    "NaN weights": (_nan, 422, "NaN"),
    "Inf weights": (_inf, 422, "Inf"),
    "wrong shapes for the base model": (_wrong_shape, 422, "does not match the base model"),
    "float64": (_float64, 422, "F64"),
    "body over the size limit": (_too_big, 413, str(UPLOAD_LIMIT)),
    "huge config JSON": (lambda c, w: {"config": b" " * (100 << 10) + c, "weights": w}, 422, "cap"),
}


async def _assert_nothing_stored(rapp, name: str, before: set[str]) -> None:
    assert rapp.store_digests() == before, "a refused upload reached the store"
    assert rapp.tmp_entries() == [], "a refused upload left temporary files"
    r = await rapp.client.get(f"/v1/models/{name}", headers=rapp.headers())
    assert r.status_code == 404


async def test_each_bad_upload_is_refused_and_stores_nothing(rapp, tiny_model):
    config, weights = adapter_files(tiny_model, 0)
    before = rapp.store_digests()
    for i, (label, (build, status, needle)) in enumerate(CASES.items()):
        name = f"bad-{i}"
        r = await rapp.upload(None, name, **build(config, weights))
        assert r.status_code == status, f"{label}: {r.status_code} {r.text[:300]}"
        error = r.json()["error"]
        assert needle in error["message"], f"{label}: {error['message']}"
        assert error["param"], label
        await _assert_nothing_stored(rapp, name, before)
        listed = {a["name"]: a for a in (await rapp.client.get("/v1/adapters", headers=rapp.headers())).json()["data"]}
        if name in listed:  # the attempt is on record, failed with its reason, never servable
            assert listed[name]["status"] == "failed" and listed[name]["latest_version"] is None
            assert needle in listed[name]["versions"][0]["error"]


def _multipart(parts: list[tuple[str, str | None, bytes]]) -> tuple[bytes, str]:
    """A multipart body with its parts in the order given (``httpx`` always puts text fields first)."""
    boundary = "lpx-test-boundary"
    out = bytearray()
    for name, filename, data in parts:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        out += f"--{boundary}\r\nContent-Disposition: {disposition}\r\n\r\n".encode() + data + b"\r\n"
    out += f"--{boundary}--\r\n".encode()
    return bytes(out), f"multipart/form-data; boundary={boundary}"


async def test_a_form_refused_on_its_fields_leaves_no_adapter_on_record(rapp, tiny_model):
    """Refusals the form alone decides (the caller's fields, missing or extra files), wherever in the body the
    fields come, leave nothing behind: no `failed` adapter under the name, no version number used up. (A
    refusal of the content itself keeps its failed version on record: see the test above.)"""
    alice = await rapp.tenant("alice")
    config, weights = adapter_files(tiny_model, 0)
    files = [("config", "adapter_config.json", config), ("weights", "adapter_model.safetensors", weights)]
    cases = {
        "public after the files": ([("name", None, b"late")] + files + [("visibility", None, b"public")], 403,
                                   "visibility"),
        "bad visibility after the files": ([("name", None, b"late")] + files + [("visibility", None, b"everyone")],
                                           400, "visibility"),
        "long description after the files": ([("name", None, b"late")] + files
                                             + [("description", None, b"x" * 2000)], 400, "description"),
        "unknown field after the files": ([("name", None, b"late")] + files + [("colour", None, b"red")], 400,
                                          "colour"),
        "a field twice": ([("name", None, b"late")] + files + [("name", None, b"late")], 400, "name"),
        "no weights": ([("name", None, b"late"), files[0]], 400, "weights"),
        "archive and files": ([("name", None, b"late")] + files
                              + [("archive", "a.tar.gz", tar_gz({"adapter_config.json": config}))], 400, "archive"),
        "name after the files": (files + [("name", None, b"Bad Name")], 400, "name"),
    }
    for label, (parts, status, param) in cases.items():
        body, content_type = _multipart(parts)
        r = await rapp.client.post("/v1/adapters", content=body,
                                   headers={**rapp.headers(alice), "Content-Type": content_type})
        assert r.status_code == status and r.json()["error"]["param"] == param, (label, r.status_code, r.text)
        listed = (await rapp.client.get("/v1/adapters", headers=rapp.headers(alice))).json()["data"]
        assert listed == [], (label, listed)
        assert (await rapp.client.get("/v1/adapters/late", headers=rapp.headers(alice))).status_code == 404, label
    assert rapp.store_digests() == set() and rapp.tmp_entries() == []
    body, content_type = _multipart([("name", None, b"late")] + files)
    r = await rapp.client.post("/v1/adapters", content=body, headers={**rapp.headers(alice), "Content-Type": content_type})
    assert r.status_code == 201 and r.json()["version"] == 1, r.text  # no number was used up
    assert [v["status"] for v in r.json()["versions"]] == ["ready"]


@pytest.mark.parametrize("change, needle", [
    ({"auto_map": {"AutoModel": "evil.Model"}}, "auto_map"),
    ({"target_modules": ["q_proj", "lm_head"]}, "unknown target module"),
    ({"r": 64}, "rank 64"),
])
async def test_bad_configs_are_refused(rapp, tiny_model, change, needle):
    config, weights = adapter_files(tiny_model, 0)
    before = rapp.store_digests()
    r = await rapp.upload(None, "cfg", config=config_with(config, **change), weights=weights)
    assert r.status_code == 422, r.text
    assert needle in r.json()["error"]["message"]
    await _assert_nothing_stored(rapp, "cfg", before)


async def test_rank_over_the_server_limit_is_refused(rapp, tiny_model):
    config, weights = adapter_files(tiny_model, 5)  # rank 64; this server's max_lora_rank is 32
    assert json.loads(config)["r"] == 64
    r = await rapp.upload(None, "big-rank", config=config, weights=weights)
    assert r.status_code == 422
    assert "max_lora_rank" in r.json()["error"]["message"] and "32" in r.json()["error"]["message"]
    await _assert_nothing_stored(rapp, "big-rank", set())


async def test_malformed_forms_are_400s(rapp, tiny_model):
    config, weights = adapter_files(tiny_model, 0)
    r = await rapp.upload(None, None, config=config, weights=weights)
    assert r.status_code == 400 and r.json()["error"]["param"] == "name"
    assert r.json()["error"]["message"].startswith("name is required"), r.text
    r = await rapp.upload(None, "../etc", config=config, weights=weights)
    assert r.status_code == 400 and r.json()["error"]["param"] == "name"
    assert "1-64 characters" in r.json()["error"]["message"]
    for archive, says in ((b"", "it is empty"), (b"PK\x03", "its first bytes are b'PK\\x03'")):
        r = await rapp.upload(None, "odd", archive=archive)
        assert r.status_code == 422 and says in r.json()["error"]["message"], r.text
    r = await rapp.upload(None, "half", config=config)
    assert r.status_code == 400 and r.json()["error"]["param"] == "weights"
    r = await rapp.upload(None, "both", config=config, weights=weights, archive=tar_gz({"a": b"b"}))
    assert r.status_code == 400 and r.json()["error"]["param"] == "archive"
    r = await rapp.client.post("/v1/adapters", json={"name": "x"}, headers=rapp.headers())
    assert r.status_code == 415
    assert rapp.tmp_entries() == [] and rapp.store_digests() == set()


async def test_a_stalled_body_is_cut_off(tmp_path, tiny_model):
    """A client that stops sending mid-file gets 408 after the idle timeout (a real Litestar Request over an
    ASGI receive that stalls)."""
    import asyncio

    from litestar import Request

    from loraplex.platform.registry.routes import upload_adapter
    from loraplex.platform.registry.upload import receive_upload

    config, _ = adapter_files(tiny_model, 0)
    boundary = "b0undary"
    head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"name\"\r\n\r\nslow\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"config\"; "
            f"filename=\"adapter_config.json\"\r\n\r\n").encode() + config
    sent = []

    async def receive():
        if not sent:
            sent.append(1)
            return {"type": "http.request", "body": head, "more_body": True}
        await asyncio.sleep(30)  # the client stalls
        return {"type": "http.disconnect"}

    scope = {"type": "http", "method": "POST", "path": "/v1/adapters", "headers": [
        (b"content-type", f"multipart/form-data; boundary={boundary}".encode())], "query_string": b"",
        "route_handler": upload_adapter, "app": None, "state": {}}
    seen = []
    with pytest.raises(ApiError) as exc:
        await receive_upload(Request(scope, receive), tmp_path, 1 << 20, 0.3,
                             on_first_file=lambda form: _record(seen, form))
    assert exc.value.status_code == 408 and "stalled" in exc.value.message
    assert seen == [{"name": "slow"}]  # the name was checked before the file body was read


async def test_a_trickling_body_hits_the_deadline(tmp_path):
    import asyncio

    from litestar import Request

    from loraplex.platform.registry.routes import upload_adapter
    from loraplex.platform.registry.upload import receive_upload

    boundary = "b0undary"
    chunks = [f"--{boundary}\r\nContent-Disposition: form-data; name=\"weights\"; filename=\"w\"\r\n\r\n"
              .encode()]

    async def receive():  # a byte every 50 ms: never idle long, never done
        if chunks:
            return {"type": "http.request", "body": chunks.pop(), "more_body": True}
        await asyncio.sleep(0.05)
        return {"type": "http.request", "body": b"x", "more_body": True}

    scope = {"type": "http", "method": "POST", "path": "/v1/adapters", "headers": [
        (b"content-type", f"multipart/form-data; boundary={boundary}".encode())], "query_string": b"",
        "route_handler": upload_adapter, "app": None, "state": {}}
    with pytest.raises(ApiError) as exc:
        await receive_upload(Request(scope, receive), tmp_path, 1 << 20, idle_timeout_s=1.0, deadline_s=0.4)
    assert exc.value.status_code == 408 and "longer than 0.4 s" in exc.value.message


def test_upload_slots_refuse_a_flood():
    from loraplex.platform.registry.upload import UploadSlots

    slots = UploadSlots(per_tenant=2, total=3)
    with slots.hold("a"), slots.hold("a"):
        with pytest.raises(ApiError) as exc, slots.hold("a"):
            pass
        assert exc.value.status_code == 429 and exc.value.headers["Retry-After"]
        with slots.hold("b"), pytest.raises(ApiError), slots.hold("c"):  # the server-wide cap
            pass
    with slots.hold("a"), slots.hold("a"):  # every slot was given back
        pass


async def _record(seen, form):
    seen.append(dict(form.fields))


async def test_control_characters_in_text_fields_are_400s_naming_the_field(rapp, tiny_model):
    """A NUL used to pass on SQLite and fail on PostgreSQL only at the final commit (after the content was
    stored), as a 400 that named no field; now both refuse it before the weights are read."""
    config, weights = adapter_files(tiny_model, 0)
    for fields, param in (({"description": "a\x00b"}, "description"), ({"description": "\x1b[31mred"}, "description"),
                          ({"shared_with": "bob\x00"}, "shared_with")):
        r = await rapp.upload(None, "ctl", config=config, weights=weights, **fields)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (fields, r.text)
    assert rapp.store_digests() == set() and rapp.tmp_entries() == []
    r = await rapp.upload(None, "ctl", config=config, weights=weights, description="two\nlines\tand tabs")
    assert r.status_code == 201 and r.json()["description"] == "two\nlines\tand tabs"
    r = await rapp.client.patch("/v1/adapters/ctl", json={"description": "x\x00"}, headers=rapp.headers())
    assert r.status_code == 400 and r.json()["error"]["param"] == "description"
    r = await rapp.client.patch("/v1/adapters/ctl", json={"shared_with": ["\x00"]}, headers=rapp.headers())
    assert r.status_code == 400 and r.json()["error"]["param"] == "shared_with"
