"""Pure pieces: model-name parsing, the content-addressed store, and archive extraction edge cases."""

from __future__ import annotations

import io
import threading
import zipfile

import pytest

from loraplex.platform.errors import ApiError
from loraplex.platform.registry.archive import MAX_MEMBERS, extract_adapter_archive
from loraplex.platform.registry.names import AdapterRef, parse_model_name
from loraplex.platform.registry.store import LocalStore, adapter_digest
from tests.unit.registry.conftest import tar_gz


@pytest.mark.parametrize("model, ref", [
    ("tone", AdapterRef(None, "tone", None)),
    ("tone@3", AdapterRef(None, "tone", 3)),
    ("acme/tone", AdapterRef("acme", "tone", None)),
    ("acme/tone@12", AdapterRef("acme", "tone", 12)),
    ("../tone", None), ("a/b/tone", None), ("/tone", None), ("tone@0", None), ("tone@x", None),
    ("tone@99999999999", None), ("Tone", None), ("", None), ("a..b", None), ("tone@", None),
])
def test_model_names(model, ref):
    assert parse_model_name(model) == ref


def _adapter(tmp_path, name: str, payload: bytes):
    d = tmp_path / name
    d.mkdir()
    (d / "adapter_config.json").write_bytes(b'{"r": 8}')
    (d / "adapter_model.safetensors").write_bytes(payload)
    return d


def test_store_is_content_addressed_and_idempotent(tmp_path):
    store = LocalStore(tmp_path / "store")
    a, b, c = _adapter(tmp_path, "a", b"x" * 100), _adapter(tmp_path, "b", b"x" * 100), _adapter(tmp_path, "c", b"y")
    assert adapter_digest(a) == adapter_digest(b) != adapter_digest(c)
    results = []
    threads = [threading.Thread(target=lambda d=d: results.append(store.put(d, adapter_digest(d))))
               for d in (a, b, a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [False, False, False, True]  # stored exactly once, racers see it there
    assert store.put(c, adapter_digest(c)) is True
    assert store.digests() == sorted({adapter_digest(a), adapter_digest(c)})
    assert (store.local_path(adapter_digest(a)) / "adapter_model.safetensors").read_bytes() == b"x" * 100
    store.delete(adapter_digest(c))
    assert not store.exists(adapter_digest(c)) and store.digests() == [adapter_digest(a)]
    with pytest.raises(ValueError):
        store.local_path("../../etc")


def test_archive_accepts_a_zip_in_a_directory_and_skips_other_files(tmp_path):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("my-adapter/", "")
        zf.writestr("my-adapter/adapter_config.json", b"{}")
        zf.writestr("my-adapter/adapter_model.safetensors", b"w" * 1000)
        zf.writestr("my-adapter/README.md", b"readme")
    archive = tmp_path / "a.zip"
    archive.write_bytes(buf.getvalue())
    out = tmp_path / "out"
    out.mkdir()
    extract_adapter_archive(archive, out, 1 << 20)
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]


@pytest.mark.parametrize("members, needle", [
    ({f"f{i}.txt": b"" for i in range(MAX_MEMBERS + 1)}, "members"),
    ({"a/adapter_config.json": b"{}", "b/adapter_model.safetensors": b"w"}, "same directory"),
    ({"adapter_config.json": b"{}"}, "no adapter_model.safetensors"),
    ({"C:/adapter_config.json": b"{}"}, "unsafe"),
    ({"x\\..\\adapter_config.json": b"{}"}, "unsafe"),
])
def test_archive_refusals_leave_nothing(tmp_path, members, needle):
    archive = tmp_path / "a.tar.gz"
    archive.write_bytes(tar_gz(members))
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ApiError) as exc:
        extract_adapter_archive(archive, out, 1 << 20)
    assert 400 <= exc.value.status_code < 500 and needle in exc.value.message
    assert list(out.iterdir()) == []


def test_not_an_archive(tmp_path):
    archive = tmp_path / "a.tar.gz"
    archive.write_bytes(b"plain text, not an archive")
    with pytest.raises(ApiError, match="must be a .tar.gz or a .zip"):
        extract_adapter_archive(archive, tmp_path, 1 << 20)
