"""A float8 e4m3 KV cache (``EngineConfig.kv_cache_dtype="fp8"``): the Triton store and attention kernels
(interpreter, fp32/fp16 queries) against the twins, the saturation at +-448, and the error the rounding of the
stored values costs against the unquantized cache."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # also set by conftest; kept here so this module runs alone

import pytest
import torch

from loraplex.kernels import fused_ops, kv_store, paged_attention
from loraplex.kernels.attention_ref import paged_attention_ref, store_kv_ref, to_cache_dtype
from loraplex.kernels.attn_testing import make_paged_batch
from loraplex.kernels.fused_ops_ref import rope_store_kv_ref

FP8 = torch.float8_e4m3fn
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=1e-2, atol=1e-2)}


def _ref(pb):
    return paged_attention_ref(pb.query, pb.key_cache, pb.value_cache, pb.block_tables, pb.query_start_loc,
                               pb.seq_lens, pb.scale)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def test_to_cache_dtype_saturates_instead_of_nan():
    x = torch.tensor([0.3, -1.0, 447.0, 500.0, -1e4, 1e30])
    y = to_cache_dtype(x, FP8).float()
    assert torch.isfinite(y).all()
    assert y[3] == 448.0 and y[4] == -448.0 and y[5] == 448.0
    assert abs(y[0] - 0.3) <= 0.3 / 16  # e4m3: 3 mantissa bits


def test_round_to_e4m3_gives_the_bits_of_torchs_cast():
    """Every e4m3 value, the midpoints between neighbours (ties go to even), values just off them, subnormals,
    zero and past the range: the kernel helper's bits equal torch's saturating cast."""
    from tests.unit.kernels.fp8_probe import round_kernel

    values = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    values = values[torch.isfinite(values)].unique()
    mids = (values[1:] + values[:-1]) / 2
    x = torch.cat([values, mids, mids * (1 + 1e-6), mids * (1 - 1e-6), torch.randn(2000) * 50,
                   torch.tensor([0.0, -0.0, 1e-12, 449.0, 465.0, -1e6, 2.0 ** -10, 3 * 2.0 ** -10])])
    out = torch.empty(x.shape, dtype=FP8)
    round_kernel[(triton_cdiv(x.numel(), 4096),)](x, out, x.numel(), BLOCK=4096)
    want = to_cache_dtype(x, FP8)
    same = out.view(torch.uint8) == want.view(torch.uint8)  # bits: -0 (a negative x rounding to zero) included
    assert same.all(), (x[~same][:8], out.float()[~same][:8], want.float()[~same][:8])
    assert (out.view(torch.uint8)[(x < 0) & (out.float() == 0)] == 0x80).all()


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_store_kv_into_fp8_matches_twin_bit_for_bit_and_saturates(dtype):
    gen = torch.Generator().manual_seed(1)
    num_blocks, block_size, kv_heads, head_dim, t = 5, 4, 2, 24, 9
    key = (torch.randn(t, kv_heads, head_dim, generator=gen) * 3).to(dtype)
    value = torch.randn(t, kv_heads, head_dim, generator=gen).to(dtype)
    key[0, 0, :3] = torch.tensor([600.0, -9000.0, 448.0], dtype=dtype)  # past e4m3's range
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:t]
    slots[4] = -1
    shape = (num_blocks, block_size, kv_heads, head_dim)
    kc = to_cache_dtype(torch.randn(shape, generator=gen), FP8)
    vc = to_cache_dtype(torch.randn(shape, generator=gen), FP8)
    want_k, want_v = kc.clone(), vc.clone()
    store_kv_ref(key, value, want_k, want_v, slots)

    kv_store.store_kv(key, value, kc, vc, slots)

    assert torch.equal(_bytes(kc), _bytes(want_k)) and torch.equal(_bytes(vc), _bytes(want_v))
    s = int(slots[0])
    row = kc[s // block_size, s % block_size, 0, :3].float()
    assert row.tolist() == [448.0, -448.0, 448.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rope_store_kv_into_fp8_matches_twin(dtype):
    gen = torch.Generator().manual_seed(2)
    t, heads, kv_heads, d, num_blocks, block_size = 7, 4, 2, 16, 4, 4
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=gen).to(dtype)
    angles = torch.rand(t, d // 2, generator=gen) * 6
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:t]
    slots[2] = -1
    shape = (num_blocks, block_size, kv_heads, d)
    kc, vc = torch.zeros(shape, dtype=FP8), torch.zeros(shape, dtype=FP8)
    want_kc, want_vc = kc.clone(), vc.clone()
    want_q = rope_store_kv_ref(qkv, cos, sin, want_kc, want_vc, slots, heads, kv_heads, d)

    q = fused_ops.rope_store_kv(qkv, cos, sin, kc, vc, slots, heads, kv_heads, d)

    torch.testing.assert_close(q, want_q, **TOL[dtype])
    assert torch.equal(_bytes(vc), _bytes(want_vc))  # v is copied: the same rounding
    # k is computed (RoPE) in the kernel and in the twin: one e4m3 step apart at most
    torch.testing.assert_close(kc.float(), want_kc.float(), rtol=0.07, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group,num_splits", [(1, 1), (4, 3), (8, 1)])
def test_decode_over_fp8_cache_matches_twin(dtype, group, num_splits):
    seq_lens = [1, 9, 33, 70]
    pb = make_paged_batch(seq_lens, [1] * len(seq_lens), 2 * group, 2, 32, 16, dtype=dtype, seed=group,
                          kv_dtype=FP8)
    assert pb.key_cache.dtype == FP8
    out = paged_attention.paged_attention_decode(pb.query, pb.key_cache, pb.value_cache, pb.block_tables,
                                                 pb.seq_lens, pb.scale, num_splits=num_splits, block_n=16)
    assert out.dtype == dtype
    torch.testing.assert_close(out, _ref(pb), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_varlen_and_mixed_over_fp8_cache_match_twin(dtype):
    seq_lens = [40, 1, 97, 23, 61, 30]
    query_lens = [1, 1, 1, 23, 0, 9]  # decodes first, a prefill, an idle row, a chunk over a cached prefix
    pb = make_paged_batch(seq_lens, query_lens, 8, 2, 32, 16, dtype=dtype, seed=7, kv_dtype=FP8)
    want = _ref(pb)
    general = paged_attention.paged_attention(pb.query, pb.key_cache, pb.value_cache, pb.block_tables,
                                              pb.query_start_loc, pb.seq_lens, pb.scale)
    torch.testing.assert_close(general, want, **TOL[dtype])
    mixed = paged_attention.paged_attention(pb.query, pb.key_cache, pb.value_cache, pb.block_tables,
                                            pb.query_start_loc, pb.seq_lens, pb.scale, num_decodes=3, max_seq_len=97)
    torch.testing.assert_close(mixed, want, **TOL[dtype])


def test_fp8_cache_costs_a_bounded_error_against_the_unquantized_cache():
    """The same keys and values stored in fp32 and in e4m3: the attention outputs differ by the rounding only."""
    seq_lens, query_lens = [50, 120, 17], [1, 30, 17]
    full = make_paged_batch(seq_lens, query_lens, 8, 2, 32, 16, seed=11)
    quant = make_paged_batch(seq_lens, query_lens, 8, 2, 32, 16, seed=11, kv_dtype=FP8)
    assert torch.equal(full.query, quant.query) and torch.equal(full.block_tables, quant.block_tables)
    assert torch.equal(quant.key_cache.float(), to_cache_dtype(full.key_cache, FP8).float())
    exact = _ref(full)
    got = paged_attention.paged_attention(quant.query, quant.key_cache, quant.value_cache, quant.block_tables,
                                          quant.query_start_loc, quant.seq_lens, quant.scale)
    err = (got - exact).abs()
    # e4m3 keeps 3 mantissa bits: each stored value within 1/16 of itself, so an output (a convex mix of values,
    # one value alone for a one-key row) within ~1/16 of the largest |v|, plus what the rounded keys move the mix
    assert 0 < err.max() < full.value_cache.abs().max() / 8, err.max()
    assert err.mean() < 0.01, err.mean()


def test_attention_rejects_a_cache_of_another_16_bit_type():
    pb = make_paged_batch([5], [1], 4, 2, 32, 16, dtype=torch.float16, seed=3, kv_dtype=torch.bfloat16)
    with pytest.raises(AssertionError, match="KV cache"):
        paged_attention.paged_attention_decode(pb.query, pb.key_cache, pb.value_cache, pb.block_tables,
                                               pb.seq_lens, pb.scale)
