"""The raw bytes of a token, which its decoded text can lose (pure Python; the tokenizer is passed in).

A token may hold part of a UTF-8 character: a byte-fallback piece ``<0xE2>`` of a SentencePiece-style
tokenizer (Llama 2, Mistral, Gemma), or a byte-level BPE token (GPT-2, Llama 3, Qwen) whose bytes end inside a
character. Decoded alone such a token is ``"\\ufffd"``, so several different tokens read the same. Their bytes
come from the token's piece in the vocabulary instead:

- byte-level BPE (a ``ByteLevel`` decoder): each character of the piece stands for one byte (GPT-2's
  bytes-to-unicode map), read back through the inverse map;
- byte fallback (a ``ByteFallback`` decoder): ``<0xNN>`` is the byte NN; other pieces are text, with the
  decoder's ``Replace`` patterns (``"▁"`` -> ``" "``) or its ``Metaspace`` replacement applied;
- added tokens (``<s>``, ``<|end|>``, ...) are their text; any other tokenizer: the UTF-8 of the decoded token.

Semantics (byte level): ``raw(id) = bytes(BYTE_OF[c] for c in piece(id))``, so for ids whose bytes together are
UTF-8, ``b"".join(raw(i) for i in ids) == decode(ids).encode()`` (special tokens as their text).
"""

from __future__ import annotations

import json
import re

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from each byte to a printable character (the alphabet of byte-level BPE vocabularies)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


_BYTE_OF = {c: b for b, c in bytes_to_unicode().items()}


def _decoders(tokenizer) -> list[dict]:
    """The backend tokenizer's decoder steps (a ``Sequence`` flattened), as their JSON descriptions."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is None:
        return []
    steps, flat = [json.loads(decoder.__getstate__())], []
    while steps:
        step = steps.pop(0)
        if step.get("type") == "Sequence":
            steps[:0] = step.get("decoders", [])
        else:
            flat.append(step)
    return flat


def _replacements(steps: list[dict]) -> list[tuple[str, str]]:
    out = []
    for step in steps:
        if step.get("type") == "Replace" and "String" in step.get("pattern", {}):
            out.append((step["pattern"]["String"], step.get("content", "")))
        elif step.get("type") == "Metaspace":
            out.append((step.get("replacement", "▁"), " "))
    return out


def escape_bytes(raw: bytes) -> str:
    """``b"\\xe2\\x80"`` -> ``"\\\\xe2\\\\x80"``: printable ASCII as itself, every other byte (and the backslash)
    as ``\\xNN``, so different bytes never give one string."""
    return "".join(chr(b) if 0x20 <= b < 0x7F and b != 0x5C else f"\\x{b:02x}" for b in raw)


class TokenBytes:
    """``token_bytes(token_id)``: the token's raw bytes; ``token_bytes.escaped(token_id)``: for a token whose bytes
    are not UTF-8 on their own, those bytes escaped (:func:`escape_bytes`), else None. Both are computed once per
    id (logprobs ask for every sampled token and its alternatives, step after step)."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._added = {i: t.content for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
        steps = _decoders(tokenizer)
        kinds = {step.get("type") for step in steps}
        self._byte_level = "ByteLevel" in kinds
        self._byte_fallback = "ByteFallback" in kinds
        self._replacements = _replacements(steps)
        self._known = self._byte_level or self._byte_fallback or bool(self._replacements)
        self._entries: dict[int, tuple[bytes, str | None]] = {}

    def __call__(self, token_id: int) -> bytes:
        return self._entry(token_id)[0]

    def escaped(self, token_id: int) -> str | None:
        return self._entry(token_id)[1]

    def _entry(self, token_id: int) -> tuple[bytes, str | None]:
        entry = self._entries.get(token_id)
        if entry is None:
            raw = self._raw(token_id)
            try:
                raw.decode("utf-8")
                entry = (raw, None)
            except UnicodeDecodeError:
                entry = (raw, escape_bytes(raw))
            self._entries[token_id] = entry
        return entry

    def _raw(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode()
        piece = self._tokenizer.convert_ids_to_tokens(token_id) if self._known else None
        if piece is None:  # no piece-level rule (or an id past the tokenizer's vocabulary): its decoded text
            return self._tokenizer.decode([token_id]).encode()
        if self._byte_level and all(c in _BYTE_OF for c in piece):
            return bytes(_BYTE_OF[c] for c in piece)
        if self._byte_fallback and (match := _BYTE_PIECE.fullmatch(piece)):
            return bytes([int(match.group(1), 16)])
        for pattern, content in self._replacements:
            piece = piece.replace(pattern, content)
        return piece.encode()
