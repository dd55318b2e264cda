"""Read and check a safetensors header ourselves, with caps, before the library parses anything.

Format: 8-byte little-endian header length N, then N bytes of JSON mapping tensor name ->
``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the data that follows), plus an
optional ``__metadata__`` of strings. A hostile file can claim a huge header or hundreds of thousands of
entries; both are refused before ``json.loads`` runs, and memory stays bounded by the caps.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from loraplex.adapters.errors import AdapterError

DTYPE_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}
DEFAULT_MAX_HEADER_BYTES = 1 << 20  # ~7,000 LoRA tensors of typical name length
MAX_METADATA_BYTES = 64 << 10


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


# What a weights upload most often is when it is not safetensors, told by its first bytes (compared, never parsed)
_FOREIGN_MAGIC = (
    (b"PK\x03\x04", "it is a zip file, as torch.save writes; uploads are never unpickled: save the adapter with "
                     "safetensors (PEFT: save_pretrained(..., safe_serialization=True))"),
    (b"\x1f\x8b", "it is gzip-compressed; send an adapter archive (.tar.gz or .zip) as the archive, not as the weights"),
)
_PICKLE_HINT = ("it is a Python pickle (torch.save's legacy format); uploads are never unpickled: save the adapter "
                "with safetensors (PEFT: save_pretrained(..., safe_serialization=True))")


def foreign_format(head: bytes) -> str | None:
    """Which other format the first bytes of a would-be safetensors file look like, or None: a pickle opens with PROTO
    (0x80) and its protocol 2-5, a zip with ``PK\\3\\4``, gzip with 1f 8b. A real safetensors file can open with
    such bytes too (its header length, little-endian: 640 is ``80 02 00 ...``), so the caller asks only once the
    header length read from them is impossible (over the cap, or longer than the file)."""
    for magic, why in _FOREIGN_MAGIC:
        if head.startswith(magic):
            return why
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return _PICKLE_HINT
    return None


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise AdapterError("duplicate key in safetensors header", tensor=key)
        out[key] = value
    return out


def read_safetensors_header(
    path: str | Path,
    *,
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
    max_tensors: int = 4096,
    max_file_bytes: int | None = None,
) -> dict[str, TensorEntry]:
    """Return the entries of a safetensors file after checking the header against the caps."""
    path = Path(path)
    name = path.name
    try:
        size = os.stat(path).st_size
    except OSError as exc:
        raise AdapterError(f"cannot read weights: {exc.strerror}", file=name) from exc
    if max_file_bytes is not None and size > max_file_bytes:
        raise AdapterError(f"weights file is {size} bytes, over the cap", file=name, limit=max_file_bytes)
    if size < 8:
        raise AdapterError("not a safetensors file (shorter than its 8-byte header length)", file=name)
    with open(path, "rb") as f:
        head = f.read(8)
        header_len = int.from_bytes(head, "little")
        foreign = foreign_format(head)
        if foreign is not None and (header_len > max_header_bytes or 8 + header_len > size):
            raise AdapterError(f"not a safetensors file: {foreign}", file=name)
        if header_len > max_header_bytes:
            raise AdapterError(f"safetensors header claims {header_len} bytes, over the cap", file=name,
                               limit=max_header_bytes)
        if header_len < 2 or 8 + header_len > size:
            raise AdapterError(f"safetensors header length {header_len} does not fit the file size {size}",
                               file=name)
        raw = f.read(header_len)
    # every entry needs a "data_offsets" key: counting them bounds the entries before any parsing
    claimed = raw.count(b'"data_offsets"')
    if claimed > max_tensors:
        raise AdapterError(f"safetensors header has {claimed} entries, over the cap", file=name,
                           limit=max_tensors)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except AdapterError as exc:
        raise AdapterError(exc.reason, file=name, tensor=exc.tensor) from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise AdapterError(f"safetensors header is not valid JSON ({exc.__class__.__name__})", file=name) from None
    if not isinstance(header, dict):
        raise AdapterError("safetensors header must be a JSON object", file=name)
    metadata = header.pop("__metadata__", None)
    if len(header) > max_tensors:  # the count before parsing misses keys spelled with JSON escapes
        raise AdapterError(f"safetensors header has {len(header)} entries, over the cap", file=name,
                           limit=max_tensors)
    if metadata is not None and (not isinstance(metadata, dict) or len(json.dumps(metadata)) > MAX_METADATA_BYTES
                                 or not all(isinstance(v, str) for v in metadata.values())):
        raise AdapterError("safetensors __metadata__ must be a small map of strings", file=name,
                           limit=MAX_METADATA_BYTES)
    return _entries(header, name, size - 8 - header_len)


def _entries(header: dict, name: str, data_len: int) -> dict[str, TensorEntry]:
    entries: dict[str, TensorEntry] = {}
    for tensor, info in header.items():
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise AdapterError("tensor entry must have exactly dtype, shape and data_offsets", file=name,
                               tensor=tensor)
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
            raise AdapterError(f"unknown dtype {dtype!r}", file=name, tensor=tensor)
        if (not isinstance(shape, list) or len(shape) > 8
                or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
            raise AdapterError("shape must be a list of non-negative integers", file=name, tensor=tensor)
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
            raise AdapterError("data_offsets must be [begin, end]", file=name, tensor=tensor)
        begin, end = offsets
        numel = 1
        for d in shape:
            numel *= d
        if not 0 <= begin <= end <= data_len or end - begin != numel * DTYPE_SIZES[dtype]:
            raise AdapterError(f"data_offsets {offsets} do not match shape {shape} ({dtype}) inside "
                               f"{data_len} data bytes", file=name, tensor=tensor)
        entries[tensor] = TensorEntry(tensor, dtype, tuple(shape), begin, end)
    spans = sorted((e.begin, e.end, e.name) for e in entries.values() if e.end > e.begin)
    for (_, prev_end, prev), (begin, _, cur) in zip(spans, spans[1:]):
        if begin < prev_end:
            raise AdapterError(f"tensor data overlaps {prev!r}", file=name, tensor=cur)
    return entries
