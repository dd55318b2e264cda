"""Content-addressed adapter storage: one directory per content digest, so identical uploads are kept once.

The digest covers both files: ``sha256("loraplex-adapter-v1" | sha256(config) | sha256(weights))``. The engine
reads adapters from a local directory (``lora_path``), so every store answers :meth:`local_path`; an
S3-compatible store would keep the objects remotely and fill a local cache directory on first use.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Protocol

from loraplex.adapters.config_check import CONFIG_NAME
from loraplex.adapters.validate import WEIGHTS_NAME

log = logging.getLogger(__name__)

ADAPTER_FILES = (CONFIG_NAME, WEIGHTS_NAME)
_DIGEST_RE = re.compile(r"^[0-9a-f]{64}\Z")
_CHUNK = 1 << 20


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def adapter_digest(directory: Path) -> str:
    """The content address of an adapter directory (its two files, nothing else)."""
    h = hashlib.sha256(b"loraplex-adapter-v1")
    for name in ADAPTER_FILES:
        h.update(bytes.fromhex(file_sha256(directory / name)))
    return h.hexdigest()


def _check_digest(digest: str) -> str:
    # digests come from our own hashing; the check keeps a corrupted row from naming a path outside the store
    if not _DIGEST_RE.match(digest):
        raise ValueError(f"not a sha256 digest: {digest!r}")
    return digest


class AdapterStore(Protocol):
    def put(self, source_dir: Path, digest: str) -> bool:
        """Store the adapter files of ``source_dir`` under ``digest``; False if already stored (idempotent)."""
        ...

    def exists(self, digest: str) -> bool: ...

    def local_path(self, digest: str) -> Path:
        """A local directory holding the adapter files (what the engine's ``lora_path`` points to)."""
        ...

    def delete(self, digest: str) -> None: ...

    def digests(self) -> list[str]: ...


class LocalStore:
    """A directory tree ``root/<d[:2]>/<digest>/{adapter_config.json, adapter_model.safetensors}``.

    Writes go to a temporary sibling first and appear with one atomic rename, so a reader (another replica,
    the engine) never sees half an adapter; two concurrent puts of the same content both succeed.
    """

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _dir(self, digest: str) -> Path:
        digest = _check_digest(digest)
        return self.root / digest[:2] / digest

    def exists(self, digest: str) -> bool:
        return all((self._dir(digest) / name).is_file() for name in ADAPTER_FILES)

    def local_path(self, digest: str) -> Path:
        return self._dir(digest)

    def put(self, source_dir: Path, digest: str) -> bool:
        final = self._dir(digest)
        if self.exists(digest):
            return False
        final.parent.mkdir(parents=True, exist_ok=True)
        staging = final.parent / f".staging-{uuid.uuid4().hex}"
        staging.mkdir()
        try:
            for name in ADAPTER_FILES:
                src, dst = source_dir / name, staging / name
                try:
                    os.link(src, dst)  # same filesystem: no copy
                except OSError:
                    shutil.copyfile(src, dst)
                os.chmod(dst, 0o444)
            try:
                os.rename(staging, final)
            except OSError:
                if self.exists(digest):  # a concurrent put of the same content won
                    return False
                raise
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
        log.info("stored adapter content %s", digest[:12])
        return True

    def delete(self, digest: str) -> None:
        target = self._dir(digest)
        if target.exists():
            # rename first so a concurrent reader sees all or nothing
            doomed = target.parent / f".deleting-{uuid.uuid4().hex}"
            os.rename(target, doomed)
            shutil.rmtree(doomed, ignore_errors=True)

    def digests(self) -> list[str]:
        return sorted(p.name for p in self.root.glob("??/*") if _DIGEST_RE.match(p.name))
