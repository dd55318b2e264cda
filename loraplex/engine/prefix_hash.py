"""Prefix-cache keys: a hash chain over full KV blocks (pure Python).

A block's key covers its parent's key, its token ids, and the request's adapter id and cache salt, so
two requests share a cached block only when everything that determined its KV values is identical.
"""

from __future__ import annotations

import hashlib
from array import array


def block_key_seed(adapter_id: int, cache_salt: str | None) -> bytes:
    """The root of every chain: different adapters or salts never share a block."""
    return hashlib.blake2b(f"lpx|{adapter_id}|{cache_salt or ''}".encode(), digest_size=16).digest()


def hash_block(parent: bytes, token_ids: list[int] | tuple[int, ...]) -> bytes:
    return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=16).digest()


def hash_full_blocks(token_ids: list[int], block_size: int, seed: bytes, known: list[bytes],
                     num_blocks: int) -> list[bytes]:
    """Extend ``known`` (keys of the first blocks) to ``num_blocks`` keys, in place, and return it."""
    parent = known[-1] if known else seed
    for i in range(len(known), num_blocks):
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size])
        known.append(parent)
    return known
