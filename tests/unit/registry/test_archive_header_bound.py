"""A tar archive's extended headers (pax, GNU long names) are read whole into memory by tarfile before any member
is seen: one claiming many bytes is refused from its size alone, so a small gzip of zeros cannot make the server
inflate and hold hundreds of megabytes."""

from __future__ import annotations

import gzip
import io
import tarfile
import tracemalloc

import pytest

from loraplex.platform.errors import ApiError
from loraplex.platform.registry.archive import MAX_TAR_HEADER_BYTES, extract_adapter_archive
from tests.unit.registry.conftest import adapter_files


def _header_bomb(kind: bytes, size: int) -> bytes:
    info = tarfile.TarInfo("././@LongLink" if kind == tarfile.GNUTYPE_LONGNAME else "././@PaxHeader")
    info.type, info.size = kind, size
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", compresslevel=9) as gz:
        gz.write(info.tobuf(format=tarfile.USTAR_FORMAT))
        zeros = b"\0" * (1 << 20)
        for _ in range(size >> 20):
            gz.write(zeros)
        gz.write(b"\0" * 1024)
    return buf.getvalue()


@pytest.mark.parametrize("kind", [tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.GNUTYPE_LONGNAME])
def test_an_oversized_extended_header_is_refused_before_it_is_read(tmp_path, kind):
    archive = tmp_path / "a.tar.gz"
    archive.write_bytes(_header_bomb(kind, 64 << 20))
    assert archive.stat().st_size < 200_000
    out = tmp_path / "out"
    out.mkdir()
    tracemalloc.start()
    try:
        with pytest.raises(ApiError) as err:
            extract_adapter_archive(archive, out, 128 << 20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert err.value.status_code == 422 and err.value.param == "archive"
    assert "header" in err.value.message
    assert peak < 8 << 20, f"{peak} bytes held while refusing"
    assert list(out.iterdir()) == []


def test_an_archive_with_ordinary_pax_headers_is_read(tmp_path, tiny_model):
    config, weights = adapter_files(tiny_model, 1)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", format=tarfile.PAX_FORMAT) as tar:
        for name, data in (("a" * 150 + "/adapter_config.json", config),
                           ("a" * 150 + "/adapter_model.safetensors", weights)):
            info = tarfile.TarInfo(name)
            info.size, info.pax_headers = len(data), {"comment": "x" * 1000}
            tar.addfile(info, io.BytesIO(data))
    archive = tmp_path / "a.tar.gz"
    archive.write_bytes(buf.getvalue())
    out = tmp_path / "out"
    out.mkdir()
    extract_adapter_archive(archive, out, 128 << 20)
    assert (out / "adapter_model.safetensors").read_bytes() == weights
    assert MAX_TAR_HEADER_BYTES >= 1 << 16
