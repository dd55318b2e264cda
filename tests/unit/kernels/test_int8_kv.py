"""An INT8 KV cache with one fp32 scale per (token, KV head) row (``kv_cache_dtype="int8"``): the Triton store
and attention kernels (interpreter, fp32/fp16 queries) against the twins, and the error of the quantization
against the unquantized cache."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # also set by conftest; kept here so this module runs alone

import pytest
import torch

from loraplex.kernels import kv_store, paged_attention
from loraplex.kernels.attention_ref import paged_attention_ref, quantize_int8_rows, store_kv_ref
from loraplex.kernels.attn_testing import make_paged_batch

I8 = torch.int8
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=1e-2, atol=1e-2)}


def _ref(pb):
    return paged_attention_ref(pb.query, pb.key_cache, pb.value_cache, pb.block_tables, pb.query_start_loc,
                               pb.seq_lens, pb.scale, **pb.scales)


def test_quantize_int8_rows_round_trip_and_zero_rows():
    x = torch.randn(5, 3, 32) * torch.tensor([1e-3, 1.0, 300.0])[None, :, None]
    x[2, 1] = 0.0
    q, s = quantize_int8_rows(x)
    assert q.dtype == I8 and s.shape == (5, 3) and s.dtype == torch.float32
    assert q.abs().max() == 127 and s[2, 1] == 0 and not q[2, 1].any()
    back = q.float() * s[..., None]
    assert ((back - x).abs() <= s[..., None] / 2 + 1e-7).all()  # half a step of each row's own scale
    assert torch.equal(q.abs().amax(-1)[s > 0], torch.full_like(s[s > 0], 127, dtype=I8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_store_kv_into_int8_matches_twin(dtype):
    gen = torch.Generator().manual_seed(1)
    num_blocks, block_size, kv_heads, head_dim, t = 5, 4, 3, 24, 9
    qkv = (torch.randn(t, (2 + 2 * kv_heads) * head_dim, generator=gen) * 5).to(dtype)
    key = qkv[:, 2 * head_dim:(2 + kv_heads) * head_dim].view(t, kv_heads, head_dim)  # views, as in the engine
    value = qkv[:, (2 + kv_heads) * head_dim:].view(t, kv_heads, head_dim)
    key[3, 1] = 0  # an all-zero row: scale 0, values 0
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:t]
    slots[4] = -1
    shape = (num_blocks, block_size, kv_heads, head_dim)
    kc, vc = torch.randint(-9, 9, shape, dtype=I8, generator=gen), torch.randint(-9, 9, shape, dtype=I8, generator=gen)
    ks, vs = torch.rand(shape[:3], generator=gen), torch.rand(shape[:3], generator=gen)
    want = [x.clone() for x in (kc, vc, ks, vs)]
    store_kv_ref(key, value, want[0], want[1], slots, want[2], want[3])

    kv_store.store_kv(key, value, kc, vc, slots, key_scale=ks, value_scale=vs)

    assert torch.equal(kc, want[0]) and torch.equal(vc, want[1])
    assert torch.equal(ks, want[2]) and torch.equal(vs, want[3])
    s = int(slots[3])
    assert ks[s // block_size, s % block_size, 1] == 0
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    assert torch.equal(ks.view(-1, kv_heads)[untouched], want[2].view(-1, kv_heads)[untouched])


def test_store_kv_into_int8_needs_its_scales():
    kc = torch.zeros(2, 4, 1, 16, dtype=I8)
    x = torch.randn(1, 1, 16)
    with pytest.raises(AssertionError, match="key_scale and value_scale"):
        kv_store.store_kv(x, x, kc, kc.clone(), torch.tensor([0]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group,num_splits", [(1, 1), (4, 3), (8, 1)])
def test_decode_over_int8_cache_matches_twin(dtype, group, num_splits):
    seq_lens = [1, 9, 33, 70]
    pb = make_paged_batch(seq_lens, [1] * len(seq_lens), 2 * group, 2, 32, 16, dtype=dtype, seed=group,
                          kv_dtype=I8)
    assert pb.key_cache.dtype == I8 and pb.key_scale is not None
    out = paged_attention.paged_attention_decode(pb.query, pb.key_cache, pb.value_cache, pb.block_tables,
                                                 pb.seq_lens, pb.scale, num_splits=num_splits, block_n=16,
                                                 **pb.scales)
    assert out.dtype == dtype
    torch.testing.assert_close(out, _ref(pb), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_varlen_and_mixed_over_int8_cache_match_twin(dtype):
    seq_lens = [40, 1, 97, 23, 61, 30]
    query_lens = [1, 1, 1, 23, 0, 9]
    pb = make_paged_batch(seq_lens, query_lens, 8, 2, 32, 16, dtype=dtype, seed=7, kv_dtype=I8)
    want = _ref(pb)
    for kw in ({}, {"num_decodes": 3, "max_seq_len": 97}):
        out = paged_attention.paged_attention(pb.query, pb.key_cache, pb.value_cache, pb.block_tables,
                                              pb.query_start_loc, pb.seq_lens, pb.scale, **kw, **pb.scales)
        torch.testing.assert_close(out, want, **TOL[dtype])


def test_int8_cache_costs_less_error_than_fp8():
    """The same keys and values in fp32, int8 with row scales and fp8 e4m3: int8's error is the smaller."""
    seq_lens, query_lens = [50, 120, 17], [1, 30, 17]
    errors = {}
    exact = _ref(make_paged_batch(seq_lens, query_lens, 8, 2, 32, 16, seed=11))
    for kv_dtype in (I8, torch.float8_e4m3fn):
        pb = make_paged_batch(seq_lens, query_lens, 8, 2, 32, 16, seed=11, kv_dtype=kv_dtype)
        out = paged_attention.paged_attention(pb.query, pb.key_cache, pb.value_cache, pb.block_tables,
                                              pb.query_start_loc, pb.seq_lens, pb.scale, **pb.scales)
        errors[kv_dtype] = (out - exact).abs().mean().item()
    assert 0 < errors[I8] < errors[torch.float8_e4m3fn] / 2, errors


def test_int8_cache_without_scales_is_refused():
    pb = make_paged_batch([5], [1], 4, 2, 32, 16, seed=3, kv_dtype=I8)
    with pytest.raises(AssertionError, match="key_scale and value_scale"):
        paged_attention.paged_attention_decode(pb.query, pb.key_cache, pb.value_cache, pb.block_tables,
                                               pb.seq_lens, pb.scale)
