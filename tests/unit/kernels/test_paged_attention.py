"""Triton paged attention (interpreter, fp32/fp16) against the pure-torch twin ``paged_attention_ref``."""

from __future__ import annotations

import os
import subprocess
import sys

os.environ["TRITON_INTERPRET"] = "1"  # also set by conftest; kept here so this module runs alone

import pytest
import torch

from loraplex.kernels import attn_decode, attn_prefill, paged_attention
from loraplex.kernels.attention_ref import paged_attention_ref
from loraplex.kernels.attn_testing import PagedBatch, make_paged_batch

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=1e-2, atol=1e-2)}


def _ref(pb: PagedBatch) -> torch.Tensor:
    return paged_attention_ref(
        pb.query, pb.key_cache, pb.value_cache, pb.block_tables, pb.query_start_loc, pb.seq_lens, pb.scale
    )


def _decode(pb: PagedBatch, **kw) -> torch.Tensor:
    return paged_attention.paged_attention_decode(
        pb.query, pb.key_cache, pb.value_cache, pb.block_tables, pb.seq_lens, pb.scale, **kw
    )


def _varlen(pb: PagedBatch, **kw) -> torch.Tensor:
    return paged_attention.paged_attention(
        pb.query, pb.key_cache, pb.value_cache, pb.block_tables, pb.query_start_loc, pb.seq_lens, pb.scale, **kw
    )


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("num_splits,block_n", [(1, 16), (3, 16), (8, 32)])
def test_decode_matches_twin_across_gqa_and_splits(group, num_splits, block_n):
    # contexts 1..100, odd lengths, a split count that leaves empty splits for short contexts
    seq_lens = [1, 7, 16, 17, 63, 100]
    pb = make_paged_batch(seq_lens, [1] * len(seq_lens), 2 * group, 2, 32, 16, seed=group)
    out = _decode(pb, num_splits=num_splits, block_n=block_n)
    torch.testing.assert_close(out, _ref(pb), **TOL[torch.float32])


@pytest.mark.parametrize("block_size", [1, 5, 32])
def test_decode_block_sizes_smaller_and_larger_than_tile(block_size):
    pb = make_paged_batch([3, 41, 77], [1, 1, 1], 8, 2, 32, block_size, seed=block_size)
    out = _decode(pb, num_splits=2, block_n=16)
    torch.testing.assert_close(out, _ref(pb), **TOL[torch.float32])


def test_decode_fp16_and_odd_head_dim():
    pb = make_paged_batch([9, 50, 99], [1, 1, 1], 4, 1, 24, 16, dtype=torch.float16, seed=3)
    out = _decode(pb, num_splits=4, block_n=16)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out, _ref(pb), **TOL[torch.float16])


def test_decode_empty_sequence_gives_zeros_not_nan():
    pb = make_paged_batch([0, 20], [0, 1], 4, 2, 32, 16, seed=4)
    # a decode batch needs one query row per sequence: give the empty sequence a row too
    pb.query = torch.randn(2, 4, 32)
    out = _decode(pb, num_splits=4, block_n=16)
    assert torch.isfinite(out).all()
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    ref = paged_attention_ref(
        pb.query[1:], pb.key_cache, pb.value_cache, pb.block_tables[1:], torch.tensor([0, 1]),
        pb.seq_lens[1:], pb.scale,
    )
    torch.testing.assert_close(out[1:], ref, **TOL[torch.float32])


def test_decode_query_view_and_out_buffer():
    # the engine's q is a view into the fused qkv projection: token stride > Hq * D
    pb = make_paged_batch([5, 30, 64], [1, 1, 1], 8, 2, 32, 16, seed=5)
    qkv = torch.randn(3, (8 + 2 * 2) * 32)
    qkv[:, : 8 * 32] = pb.query.reshape(3, -1)
    pb.query = qkv[:, : 8 * 32].view(3, 8, 32)
    out = torch.full((3, 8, 32), float("nan"))
    result = paged_attention.paged_attention(
        pb.query, pb.key_cache, pb.value_cache, pb.block_tables, pb.query_start_loc, pb.seq_lens, pb.scale,
        out=out, max_query_len=1,
    )
    assert result is out
    torch.testing.assert_close(out, _ref(pb), **TOL[torch.float32])


@pytest.mark.parametrize("group", [1, 4, 8])
def test_varlen_mixed_prefill_chunk_and_decode(group):
    # fresh prefill, chunk over a cached prefix, decode rows, and a sequence with no new token
    seq_lens = [13, 70, 41, 1, 29, 90]
    query_lens = [13, 22, 1, 1, 0, 37]
    pb = make_paged_batch(seq_lens, query_lens, 2 * group, 2, 32, 16, seed=10 + group)
    torch.testing.assert_close(_varlen(pb), _ref(pb), **TOL[torch.float32])


@pytest.mark.parametrize("block_m,block_n,block_size", [(16, 16, 16), (64, 32, 7), (32, 64, 64)])
def test_varlen_tile_shapes(block_m, block_n, block_size):
    pb = make_paged_batch([100, 35, 18], [100, 20, 3], 8, 2, 32, block_size, seed=block_m + block_size)
    out = attn_prefill.paged_attention_varlen(
        pb.query, pb.key_cache, pb.value_cache, pb.block_tables, pb.query_start_loc, pb.seq_lens, pb.scale,
        block_m=block_m, block_n=block_n,
    )
    torch.testing.assert_close(out, _ref(pb), **TOL[torch.float32])


def test_varlen_fp16_odd_head_dim_gqa_3():
    pb = make_paged_batch([33, 57], [33, 9], 6, 2, 40, 16, dtype=torch.float16, seed=21)
    out = _varlen(pb)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out, _ref(pb), **TOL[torch.float16])


def test_dispatch_decode_and_varlen_agree_on_decode_batch():
    pb = make_paged_batch([1, 31, 88, 45], [1, 1, 1, 1], 8, 2, 32, 16, seed=30)
    decode = _varlen(pb, max_query_len=1, max_seq_len=88)
    general = _varlen(pb, max_query_len=None)
    torch.testing.assert_close(decode, general, **TOL[torch.float32])
    torch.testing.assert_close(decode, _ref(pb), **TOL[torch.float32])


@pytest.mark.parametrize("group", [1, 4])
def test_mixed_batch_with_decodes_first_splits_across_both_kernels(group):
    seq_lens = [40, 1, 97, 23, 61, 30]
    query_lens = [1, 1, 1, 23, 0, 9]  # three decodes first, then a prefill, an idle row, a chunk
    pb = make_paged_batch(seq_lens, query_lens, 2 * group, 2, 32, 16, seed=40 + group)
    out = torch.full_like(pb.query, float("nan"))
    result = _varlen(pb, out=out, num_decodes=3, max_seq_len=97)
    assert result is out
    torch.testing.assert_close(out, _ref(pb), **TOL[torch.float32])
    all_decodes = make_paged_batch([5, 77], [1, 1], 2 * group, 2, 32, 16, seed=50)
    torch.testing.assert_close(_varlen(all_decodes, num_decodes=2), _ref(all_decodes), **TOL[torch.float32])


def test_mixed_batch_takes_the_varlen_part_as_tensors_of_their_own():
    """The engine passes the varlen part's lengths and block rows copied out (aligned) rather than as slices three
    rows in; the kernel must read those and not the full tensors (poisoned here past the decode rows)."""
    seq_lens = [40, 1, 97, 23, 61, 30]
    query_lens = [1, 1, 1, 23, 0, 9]
    pb = make_paged_batch(seq_lens, query_lens, 8, 2, 32, 16, seed=44)
    want = _ref(pb)
    rest = dict(rest_query_start_loc=pb.query_start_loc[3:] - 3, rest_seq_lens=pb.seq_lens[3:].clone(),
                rest_block_tables=pb.block_tables[3:].clone())
    poisoned_lens, poisoned_tables = pb.seq_lens.clone(), pb.block_tables.clone()
    poisoned_lens[3:], poisoned_tables[3:] = 10_000, -1
    out = paged_attention.paged_attention(pb.query, pb.key_cache, pb.value_cache, poisoned_tables,
                                          pb.query_start_loc, poisoned_lens, pb.scale, num_decodes=3, max_seq_len=97,
                                          **rest)
    torch.testing.assert_close(out, want, **TOL[torch.float32])


def test_num_splits_cases_lists_every_count_an_eager_step_can_pick():
    """Each split count is a kernel variant; the warm-up runs one call per case, so the cases must hold every
    count ``choose_num_splits`` returns over the batches and lengths the engine allows, each with a (batch,
    length) that gets it."""
    choose, cases_of = paged_attention.choose_num_splits, attn_decode.num_splits_cases
    for max_batch, hkv, max_len in ((64, 8, 2048), (16, 2, 700), (4, 1, 256)):
        cases = cases_of(max_batch, hkv, max_len)
        assert all(choose(b, hkv, n) == splits and b <= max_batch and n <= max_len
                   for splits, (b, n) in cases.items())
        seen = {choose(b, hkv, n) for b in range(1, max_batch + 1) for n in range(1, max_len + 1)}
        assert seen == set(cases)
    assert set(cases_of(64, 8, 2048)) == {1, 2, 4, 8}  # 2,048 keys: at most 8 splits of 256
    assert set(cases_of(4, 1, 256)) == {1}


def test_dispatch_rejects_decode_flag_with_multi_token_rows():
    pb = make_paged_batch([10, 20], [2, 1], 4, 2, 32, 16, seed=31)
    with pytest.raises(AssertionError, match="one token per sequence"):
        _varlen(pb, max_query_len=1)


def test_choose_num_splits_fills_small_batches_and_spares_short_contexts():
    choose = paged_attention.choose_num_splits
    assert choose(1, 8) == 16  # one sequence: split the keys to fill the GPU
    assert choose(64, 8) == 1  # 512 programs already cover 132 SMs twice: no merge pass
    assert choose(32, 8) == 4  # 256 programs: split to ~4 programs per SM
    assert choose(256, 8) == 1
    assert choose(1, 8, max_seq_len=300) == 2  # no split shorter than ~256 keys
    assert choose(4, 8, max_seq_len=100_000) == 16


def test_kernels_compile_for_hopper_with_pipelined_kv_loads():
    """The real Triton compiler (not the interpreter) builds every kernel for sm_90, over bf16 and float8 e4m3
    caches; needs no GPU."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run([sys.executable, "-m", "loraplex.kernels.attn_compile_check"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("ok ") == 22  # 11 over a bf16 cache, 5 over fp8 (one with fp16 dots), 4 over int8, the
    # RoPE store twice
