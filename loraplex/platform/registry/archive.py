"""Unpack an uploaded ``.tar.gz`` or ``.zip`` into a fresh directory, refusing anything dangerous.

Refused: members with absolute paths, ``..``, backslashes or drive letters; links, devices and FIFOs;
pickle weight files (by name, never opened); more than :data:`MAX_MEMBERS` members; a tar extended header over
:data:`MAX_TAR_HEADER_BYTES` (judged by its size, unread); more uncompressed
bytes than the cap (counted on the bytes actually produced, so a lying header or a gzip bomb is stopped
at the cap). Only ``adapter_config.json`` and ``adapter_model.safetensors`` are written, both from the
same directory of the archive; any other regular file (a README) is skipped unread.
"""

from __future__ import annotations

import gzip
import lzma
import struct
import tarfile
import zipfile
import zlib
from pathlib import Path, PurePosixPath

from loraplex.adapters.validate import PICKLE_SUFFIXES
from loraplex.platform.errors import ApiError
from loraplex.platform.registry.store import ADAPTER_FILES

MAX_MEMBERS = 64
_COPY_CHUNK = 1 << 16
# a tar's extended headers (pax records, GNU long names) are read whole into memory by tarfile before the member
# they describe is seen, whatever size they claim: a pax header of 500 MB of zeros gzips to 500 KB
MAX_TAR_HEADER_BYTES = 1 << 20
_EXTENDED_HEADERS = (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE, tarfile.GNUTYPE_LONGNAME,
                     tarfile.GNUTYPE_LONGLINK)


def rejected(message: str, status: int = 422, code: str = "archive_rejected") -> ApiError:
    return ApiError(status, message, param="archive", code=code)


class _Budget:
    """Uncompressed bytes left; raises once the archive produces more than the cap."""

    def __init__(self, cap: int):
        self.cap, self.left = cap, cap

    def take(self, n: int) -> None:
        self.left -= n
        if self.left < 0:
            raise rejected(f"archive expands to more than {self.cap} bytes (limit: {self.cap} bytes uncompressed)",
                           status=413, code="archive_too_large")


class _CountingReader:
    """A file object that charges every decompressed byte to the budget (tar streams through it)."""

    def __init__(self, raw, budget: _Budget):
        self._raw, self._budget = raw, budget

    def read(self, n: int = -1) -> bytes:
        data = self._raw.read(n if n is not None and n >= 0 else _COPY_CHUNK)
        self._budget.take(len(data))
        return data


def _member_path(name: str) -> PurePosixPath:
    if not name or "\\" in name or "\x00" in name or name.startswith("/") or (len(name) > 1 and name[1] == ":"):
        raise rejected(f"archive member {name[:200]!r} has an absolute or unsafe path")
    path = PurePosixPath(name)
    if any(part == ".." for part in path.parts):
        raise rejected(f"archive member {name[:200]!r} contains '..'")
    return path


def _wanted(path: PurePosixPath) -> bool:
    """Whether to extract this regular file; refuses pickles by name (they are never opened)."""
    if path.name.lower().endswith(PICKLE_SUFFIXES):
        raise rejected(f"archive member {str(path)[:200]!r} is a pickle-format file; only safetensors weights "
                       "are accepted (adapter_model.safetensors)")
    return path.name in ADAPTER_FILES


class _Collector:
    """Remembers which directory of the archive holds the adapter files and writes them out."""

    def __init__(self, out_dir: Path, budget: _Budget):
        self.out_dir, self.budget = out_dir, budget
        self.parent: PurePosixPath | None = None
        self.seen: set[str] = set()
        self.count = 0

    def member(self) -> None:
        self.count += 1
        if self.count > MAX_MEMBERS:
            raise rejected(f"archive has more than {MAX_MEMBERS} members (limit: {MAX_MEMBERS})")

    def write(self, path: PurePosixPath, src, charge: bool) -> None:
        """Copy one adapter file out; ``charge`` counts its bytes (tar counts at the gzip stream instead)."""
        if path.name in self.seen:
            raise rejected(f"archive holds more than one {path.name}")
        if self.parent is not None and path.parent != self.parent:
            raise rejected("adapter_config.json and adapter_model.safetensors must be in the same directory "
                           "of the archive")
        self.parent = path.parent
        self.seen.add(path.name)
        with open(self.out_dir / path.name, "xb") as dst:
            while chunk := src.read(_COPY_CHUNK):
                if charge:
                    self.budget.take(len(chunk))
                dst.write(chunk)

    def finish(self) -> None:
        missing = [n for n in ADAPTER_FILES if n not in self.seen]
        if missing:
            raise rejected(f"archive has no {' or '.join(missing)}")


class _BoundedTarInfo(tarfile.TarInfo):
    """Refuses an extended header by the size it claims, before tarfile reads it into memory."""

    def _proc_member(self, tarfile_):
        if self.type in _EXTENDED_HEADERS and self.size > MAX_TAR_HEADER_BYTES:
            raise rejected(f"archive has an extended tar header of {self.size} bytes (limit: "
                           f"{MAX_TAR_HEADER_BYTES})")
        return super()._proc_member(tarfile_)


def _extract_tar(archive: Path, out: _Collector) -> None:
    with gzip.open(archive, "rb") as gz:
        reader = _CountingReader(gz, out.budget)
        try:
            with tarfile.open(fileobj=reader, mode="r|", tarinfo=_BoundedTarInfo) as tar:
                for member in tar:
                    out.member()
                    path = _member_path(member.name)
                    if member.isdir():
                        continue
                    if not member.isfile():
                        raise rejected(f"archive member {member.name[:200]!r} is a link or special file; only "
                                       "regular files are accepted")
                    if member.size > out.budget.cap:
                        raise rejected(f"archive member {member.name[:200]!r} claims {member.size} bytes "
                                       f"(limit: {out.budget.cap})", status=413, code="archive_too_large")
                    if _wanted(path):
                        src = tar.extractfile(member)
                        assert src is not None
                        out.write(path, src, charge=False)
            # to the end of the gzip stream, where its CRC is checked: tar stops at its end-of-archive blocks,
            # so damaged bytes that still inflate were taken as the adapter's
            while reader.read(_COPY_CHUNK):
                pass
        except (tarfile.TarError, EOFError, OSError, gzip.BadGzipFile, zlib.error) as exc:
            raise rejected(f"archive is not a valid .tar.gz ({type(exc).__name__}: {str(exc)[:200]})") from None


def _zip_entry_count(archive: Path) -> int | None:
    """Entries the end-of-central-directory record claims, read before zipfile loads the whole directory."""
    size = archive.stat().st_size
    with open(archive, "rb") as f:
        f.seek(max(0, size - (1 << 16) - 22))
        tail = f.read()
    at = tail.rfind(b"PK\x05\x06")
    if at < 0 or len(tail) - at < 22:
        return None
    return struct.unpack("<H", tail[at + 10:at + 12])[0]


def _extract_zip(archive: Path, out: _Collector) -> None:
    count = _zip_entry_count(archive)
    if count is None:
        raise rejected("archive is not a valid .zip (no end of central directory)")
    if count > MAX_MEMBERS:  # also refuses zip64's 0xFFFF marker
        raise rejected(f"archive has {count} members (limit: {MAX_MEMBERS})")
    try:
        with zipfile.ZipFile(archive) as zf:
            for info in zf.infolist():
                out.member()
                path = _member_path(info.filename)
                mode = (info.external_attr >> 16) & 0o170000
                if info.is_dir():
                    continue
                if mode not in (0, 0o100000):  # symlinks (0o120000) and other special files
                    raise rejected(f"archive member {info.filename[:200]!r} is a link or special file; only "
                                   "regular files are accepted")
                if info.flag_bits & 0x1:  # zipfile's answer to it is a RuntimeError (a password is needed)
                    raise rejected(f"archive member {info.filename[:200]!r} is encrypted; send an archive without a "
                                   "password")
                if info.file_size > out.budget.cap:
                    raise rejected(f"archive member {info.filename[:200]!r} claims {info.file_size} bytes "
                                   f"(limit: {out.budget.cap})", status=413, code="archive_too_large")
                if _wanted(path):
                    with zf.open(info) as src:
                        out.write(path, src, charge=True)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, OSError, NotImplementedError, zlib.error,
            lzma.LZMAError) as exc:
        raise rejected(f"archive is not a valid .zip ({type(exc).__name__}: {str(exc)[:200]})") from None


def extract_adapter_archive(archive: Path, out_dir: Path, max_uncompressed_bytes: int) -> None:
    """Write the adapter files of ``archive`` into ``out_dir`` (which must be empty). Raises ApiError (4xx)."""
    with open(archive, "rb") as f:
        magic = f.read(4)
    out = _Collector(out_dir, _Budget(max_uncompressed_bytes))
    try:
        if magic[:2] == b"\x1f\x8b":
            _extract_tar(archive, out)
        elif magic == b"PK\x03\x04" or magic == b"PK\x05\x06":
            _extract_zip(archive, out)
        else:
            what = "it is empty" if not magic else f"its first bytes are {magic!r}"
            raise rejected(f"archive must be a .tar.gz or a .zip, and {what} (neither a gzip nor a zip header)")
        out.finish()
    except BaseException:
        for name in ADAPTER_FILES:  # nothing half-written survives a refusal
            (out_dir / name).unlink(missing_ok=True)
        raise

