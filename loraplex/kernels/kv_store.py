"""Triton kernel that writes the new tokens' K/V into the paged KV cache.

Semantics (twin: ``attention_ref.store_kv_ref``)::

    for t in range(T):
        s = slot_mapping[t]                    # s = block_id * block_size + offset, -1 = padding
        if s >= 0:
            key_cache[s // block_size, s % block_size] = key[t]
            value_cache[s // block_size, s % block_size] = value[t]

Shape:
    key, value:               [T, Hkv, D]   (token and head strides free, last dim contiguous)
    key_cache, value_cache:   [num_blocks, block_size, Hkv, D]   (contiguous)
    slot_mapping:             [T] int32 or int64

One program per token copies its ``Hkv * D`` values of K and of V. Offsets into the cache are int64
(a 100 GB cache overflows int32). Into a float8 e4m3 cache (scale 1, ``FP8=True``) the values are rounded
to e4m3 first, saturating at +-448 as the twin does (``kernels/fp8.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels.fp8 import quantize_int8_rows, round_to_e4m3
from loraplex.kernels.host_math import next_power_of_2
from loraplex.kernels.launch import fast_launch


@fast_launch
@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    block_size,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK: tl.constexpr,  # next power of two >= NUM_KV_HEADS * HEAD_DIM
    FP8: tl.constexpr = False,  # float8 e4m3 cache: saturate at +-448
):
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot < 0:
        return
    block_id = slot // block_size
    offset = slot % block_size
    i = tl.arange(0, BLOCK)
    mask = i < NUM_KV_HEADS * HEAD_DIM
    head = i // HEAD_DIM
    d = i % HEAD_DIM
    src_k = t.to(tl.int64) * stride_kt + head * stride_kh + d
    src_v = t.to(tl.int64) * stride_vt + head * stride_vh + d
    dst = block_id * stride_cache_block + offset * stride_cache_slot + head * stride_cache_head + d
    k = tl.load(key_ptr + src_k, mask=mask)
    v = tl.load(value_ptr + src_v, mask=mask)
    if FP8:
        k = round_to_e4m3(k).to(k.dtype)  # e4m3 values are exact in 16 bits
        v = round_to_e4m3(v).to(v.dtype)
    tl.store(key_cache_ptr + dst, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + dst, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int32/int64, -1 = do not store
    key_scale: torch.Tensor | None = None,  # INT8 cache: [num_blocks, block_size, Hkv] fp32 row scales
    value_scale: torch.Tensor | None = None,
) -> None:
    """Write ``key``/``value`` rows into the cache slots named by ``slot_mapping`` (see module doc)."""
    if key_cache.dtype == torch.int8:
        assert key_scale is not None and value_scale is not None, "an INT8 KV cache needs key_scale and value_scale"
        return store_kv_int8(key, value, key_cache, value_cache, key_scale, value_scale, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape, f"value {tuple(value.shape)} != key {tuple(key.shape)}"
    assert key_cache.shape == value_cache.shape and key_cache.dim() == 4
    assert key_cache.shape[2:] == (num_kv_heads, head_dim), (
        f"cache heads/dim {tuple(key_cache.shape[2:])} != key {(num_kv_heads, head_dim)}"
    )
    assert key_cache.is_contiguous() and value_cache.is_contiguous(), "KV cache must be contiguous"
    assert key_cache.dtype == value_cache.dtype
    assert key.stride(2) == 1 and value.stride(2) == 1, "last dim of key/value must be contiguous"
    assert slot_mapping.shape == (num_tokens,), f"slot_mapping {tuple(slot_mapping.shape)} != ({num_tokens},)"
    assert slot_mapping.dtype in (torch.int32, torch.int64)
    assert key.device == key_cache.device == slot_mapping.device
    if num_tokens == 0:
        return
    block_size = key_cache.shape[1]
    _store_kv_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        block_size,
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK=next_power_of_2(num_kv_heads * head_dim), FP8=key_cache.dtype == torch.float8_e4m3fn,
        num_warps=4,
    )


@fast_launch
@triton.jit
def _store_kv_int8_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,  # int8
    value_cache_ptr,  # int8
    key_scale_ptr,  # fp32 [num_blocks, block_size, Hkv]
    value_scale_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    block_size,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot < 0:
        return
    block_id = slot // block_size
    offset = slot % block_size
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h < NUM_KV_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
    dst = block_id * stride_cache_block + offset * stride_cache_slot + h[:, None] * stride_cache_head + d[None, :]
    scale_dst = slot * NUM_KV_HEADS + h
    k = tl.load(key_ptr + t.to(tl.int64) * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask, other=0.0)
    q, s = quantize_int8_rows(k)
    tl.store(key_cache_ptr + dst, q, mask=mask)
    tl.store(key_scale_ptr + scale_dst, s, mask=h < NUM_KV_HEADS)
    v = tl.load(value_ptr + t.to(tl.int64) * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask, other=0.0)
    q, s = quantize_int8_rows(v)
    tl.store(value_cache_ptr + dst, q, mask=mask)
    tl.store(value_scale_ptr + scale_dst, s, mask=h < NUM_KV_HEADS)


def store_kv_int8(key, value, key_cache, value_cache, key_scale, value_scale, slot_mapping) -> None:
    """``store_kv`` into an INT8 cache: each (token, KV head) row stored as round(x / s) with its own fp32 scale
    s = max|x| / 127 in ``key_scale``/``value_scale`` [num_blocks, block_size, Hkv] (twin: ``store_kv_ref``)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    assert key_cache.dtype == value_cache.dtype == torch.int8 and key_cache.is_contiguous() and value_cache.is_contiguous()
    assert key_scale.shape == value_scale.shape == key_cache.shape[:3] and key_scale.dtype == torch.float32
    assert key_scale.is_contiguous() and value_scale.is_contiguous()
    assert key.stride(2) == 1 and value.stride(2) == 1 and slot_mapping.shape == (num_tokens,)
    if num_tokens == 0:
        return
    _store_kv_int8_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, key_scale, value_scale, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), key_cache.shape[1],
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_H=next_power_of_2(num_kv_heads),
        BLOCK_D=next_power_of_2(head_dim), num_warps=4,
    )
