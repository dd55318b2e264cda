"""Validated adapter weights shared by every adapter id that reads the same, unchanged files.

Many ids may name one directory (tenants sharing an adapter, the offline bench's 1,000 ids over 16 files):
the files are then read and validated (finite values included) once per file identity, not once per id.
The identity is the directory's real path plus (device, inode, size, mtime_ns) of both files, taken
before the read, so a file rewritten or replaced on disk is read and validated again. Entries are weak:
weights live as long as the host cache (or a slot fill in progress) holds an adapter using them, so host
memory stays bounded by ``max_cpu_loras`` as before. Pure bookkeeping: no torch.
"""

from __future__ import annotations

import os
import weakref
from typing import Generic, TypeVar

from loraplex.adapters.config_check import CONFIG_NAME
from loraplex.adapters.validate import WEIGHTS_NAME

V = TypeVar("V")
FileKey = tuple


def file_key(path: str | os.PathLike) -> FileKey | None:
    """Identity of an adapter directory's files; None when either cannot be stat'ed (the read then fails
    with its own clear error)."""
    root = os.path.realpath(path)
    try:
        stats = [os.stat(os.path.join(root, name)) for name in (CONFIG_NAME, WEIGHTS_NAME)]
    except OSError:
        return None
    return (root, *((s.st_dev, s.st_ino, s.st_size, s.st_mtime_ns) for s in stats))


class ValidatedFiles(Generic[V]):
    """file identity -> validated host weights, held weakly."""

    def __init__(self) -> None:
        self._by_key: weakref.WeakValueDictionary[FileKey, V] = weakref.WeakValueDictionary()

    def __len__(self) -> int:
        return len(self._by_key)

    def get(self, key: FileKey | None) -> V | None:
        return None if key is None else self._by_key.get(key)

    def put(self, key: FileKey | None, item: V) -> None:
        if key is not None:
            self._by_key[key] = item
