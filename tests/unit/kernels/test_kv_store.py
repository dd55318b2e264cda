"""Triton KV store (interpreter) against the twin ``store_kv_ref``."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # also set by conftest; kept here so this module runs alone

import pytest
import torch

from loraplex.kernels import kv_store
from loraplex.kernels.attention_ref import store_kv_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_store_kv_matches_twin_and_skips_padding(dtype, slot_dtype):
    gen = torch.Generator().manual_seed(0)
    num_blocks, block_size, kv_heads, head_dim, num_tokens = 6, 5, 3, 24, 11
    # K and V are views into one fused qkv output (token stride > Hkv * D), as in the engine
    qkv = torch.randn(num_tokens, (4 + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    key = qkv[:, 4 * head_dim : (4 + kv_heads) * head_dim].view(num_tokens, kv_heads, head_dim)
    value = qkv[:, (4 + kv_heads) * head_dim :].view(num_tokens, kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[2, 7]] = -1  # padding rows
    slot_mapping = slots.to(slot_dtype)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    key_cache, value_cache = torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype)
    want_k, want_v = key_cache.clone(), value_cache.clone()
    store_kv_ref(key, value, want_k, want_v, slot_mapping)

    kv_store.store_kv(key, value, key_cache, value_cache, slot_mapping)

    assert torch.equal(key_cache, want_k)
    assert torch.equal(value_cache, want_v)
    # a stored row is really there (the twin could be wrong the same way otherwise)
    s = int(slots[0])
    assert torch.equal(key_cache[s // block_size, s % block_size], key[0])


def test_store_kv_no_tokens_is_a_no_op():
    cache = torch.randn(2, 4, 1, 16)
    before = cache.clone()
    empty = torch.empty(0, 1, 16)
    kv_store.store_kv(empty, empty, cache, cache, torch.empty(0, dtype=torch.int64))
    assert torch.equal(cache, before)
