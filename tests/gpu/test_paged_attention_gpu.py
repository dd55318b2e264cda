"""Compiled Triton paged attention and KV store on CUDA in bfloat16 against the fp32 twins.

Contexts up to 33k keys, odd lengths, thousands of blocks in random order, GQA 1/4/8 at Llama-3-8B's
head shape (8 KV heads, head_dim 128), chunked prefill over a long cached prefix, a cache past 2^31
elements (int64 offsets) and CUDA-graph replay of a decode step with new contexts.
"""

from __future__ import annotations

import pytest
import torch

from loraplex.kernels.attention_ref import paged_attention_ref, store_kv_ref
from loraplex.kernels.attn_testing import PagedBatch, make_paged_batch
from loraplex.kernels.kv_store import store_kv
from loraplex.kernels.paged_attention import paged_attention, paged_attention_decode

DEV = "cuda"
KV_HEADS, HEAD_DIM, BLOCK = 8, 128, 16
# bf16 P (before P @ V) and a bf16 output; queries are scaled up so attention is peaked and the
# outputs are O(1): an absolute tolerance then cannot hide a wrong block or a wrong mask
TOL = dict(rtol=2e-2, atol=1e-2)


@pytest.fixture(scope="module", autouse=True)
def compiled_triton():
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(tl.cdiv, InterpretedFunction):
        pytest.skip("triton was imported with TRITON_INTERPRET=1: run tests/gpu in its own pytest process")


def _batch(seq_lens, query_lens, group, seed, query_gain=3.0) -> PagedBatch:
    pb = make_paged_batch(
        seq_lens, query_lens, KV_HEADS * group, KV_HEADS, HEAD_DIM, BLOCK,
        dtype=torch.bfloat16, device=DEV, seed=seed,
    )
    pb.query = (pb.query.float() * query_gain).to(torch.bfloat16)
    return pb


def _ref(pb: PagedBatch) -> torch.Tensor:
    return paged_attention_ref(
        pb.query, pb.key_cache, pb.value_cache, pb.block_tables, pb.query_start_loc, pb.seq_lens, pb.scale
    )


def _check(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref.float(), **TOL)


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("num_splits", [None, 1, 5])
def test_decode_long_odd_contexts(group, num_splits):
    seq_lens = [1, 17, 1023, 4099, 33_001]
    pb = _batch(seq_lens, [1] * len(seq_lens), group, seed=group)
    out = paged_attention_decode(
        pb.query, pb.key_cache, pb.value_cache, pb.block_tables, pb.seq_lens, pb.scale, num_splits=num_splits
    )
    _check(out, _ref(pb))


def test_decode_batch_64_random_contexts_through_dispatch():
    gen = torch.Generator().manual_seed(7)
    seq_lens = (torch.randint(1, 2048, (64,), generator=gen) * 2 + 1).tolist()  # odd, up to 4k
    pb = _batch(seq_lens, [1] * 64, 4, seed=8)
    out = paged_attention(
        pb.query, pb.key_cache, pb.value_cache, pb.block_tables, pb.query_start_loc, pb.seq_lens, pb.scale,
        max_query_len=1, max_seq_len=max(seq_lens),
    )
    _check(out, _ref(pb))
    general = paged_attention(
        pb.query, pb.key_cache, pb.value_cache, pb.block_tables, pb.query_start_loc, pb.seq_lens, pb.scale,
    )
    _check(general, _ref(pb))


def test_chunked_prefill_over_32k_prefix_mixed_with_prefill_and_decode():
    # a 515-token chunk after a 32k cached prefix, a fresh prefill, decode rows, a sequence with no new token
    seq_lens = [32_771, 1000, 5000, 77, 300]
    query_lens = [515, 1000, 1, 1, 0]
    pb = _batch(seq_lens, query_lens, 4, seed=11)
    out = paged_attention(
        pb.query, pb.key_cache, pb.value_cache, pb.block_tables, pb.query_start_loc, pb.seq_lens, pb.scale,
    )
    _check(out, _ref(pb))


@pytest.mark.parametrize("group", [1, 8])
def test_varlen_gqa_odd_chunks(group):
    seq_lens = [2999, 1, 641, 130, 2048]
    query_lens = [333, 1, 641, 7, 1]
    pb = _batch(seq_lens, query_lens, group, seed=20 + group)
    out = paged_attention(
        pb.query, pb.key_cache, pb.value_cache, pb.block_tables, pb.query_start_loc, pb.seq_lens, pb.scale,
    )
    _check(out, _ref(pb))


def test_store_kv_bf16_matches_twin():
    gen = torch.Generator(device=DEV).manual_seed(3)
    num_tokens, num_blocks = 777, 100
    qkv = torch.randn(num_tokens, (32 + 2 * KV_HEADS) * HEAD_DIM, device=DEV, generator=gen).bfloat16()
    key = qkv[:, 32 * HEAD_DIM : 40 * HEAD_DIM].view(num_tokens, KV_HEADS, HEAD_DIM)
    value = qkv[:, 40 * HEAD_DIM :].view(num_tokens, KV_HEADS, HEAD_DIM)
    slots = torch.randperm(num_blocks * BLOCK, device=DEV, generator=gen)[:num_tokens]
    slots[::13] = -1
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    key_cache = torch.randn(shape, device=DEV, generator=gen).bfloat16()
    value_cache = torch.randn(shape, device=DEV, generator=gen).bfloat16()
    want_k, want_v = key_cache.clone(), value_cache.clone()
    store_kv_ref(key, value, want_k, want_v, slots)
    store_kv(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, want_k) and torch.equal(value_cache, want_v)


def test_int64_offsets_cache_over_2g_elements():
    """Blocks past 2^31 elements of a 4.3 GB cache: store, then decode and prefill read them back."""
    num_blocks = (1 << 31) // (BLOCK * KV_HEADS * HEAD_DIM) + 64
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    key_cache = torch.empty(shape, device=DEV, dtype=torch.bfloat16)
    value_cache = torch.empty(shape, device=DEV, dtype=torch.bfloat16)
    seq_len = 200
    blocks = torch.arange(num_blocks - 1, num_blocks - 14, -1, device=DEV, dtype=torch.int32)  # 13 high blocks
    gen = torch.Generator(device=DEV).manual_seed(5)
    key = torch.randn(seq_len, KV_HEADS, HEAD_DIM, device=DEV, generator=gen).bfloat16()
    value = torch.randn(seq_len, KV_HEADS, HEAD_DIM, device=DEV, generator=gen).bfloat16()
    positions = torch.arange(seq_len, device=DEV)
    slots = blocks.long()[positions // BLOCK] * BLOCK + positions % BLOCK
    store_kv(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache[int(blocks[12])].reshape(-1)[: 8 * KV_HEADS * HEAD_DIM],
                       key[192:].reshape(-1))

    block_tables = blocks[None, :]
    seq_lens = torch.tensor([seq_len], device=DEV, dtype=torch.int32)
    for q_len in (1, 37):
        query = (torch.randn(q_len, 4 * KV_HEADS, HEAD_DIM, device=DEV, generator=gen) * 3).bfloat16()
        qsl = torch.tensor([0, q_len], device=DEV, dtype=torch.int32)
        ref = paged_attention_ref(query, key_cache, value_cache, block_tables, qsl, seq_lens, HEAD_DIM**-0.5)
        out = paged_attention(query, key_cache, value_cache, block_tables, qsl, seq_lens, HEAD_DIM**-0.5,
                              max_query_len=q_len)
        _check(out, ref)
    del key_cache, value_cache
    torch.cuda.empty_cache()


def test_decode_cuda_graph_replay_with_new_contexts():
    """Split count comes from shapes only: a graph captured on short contexts is right on long ones."""
    batch = 8
    small = _batch([5] * batch, [1] * batch, 4, seed=30)
    big = _batch([3001, 1, 17, 4096, 999, 2, 64, 1500], [1] * batch, 4, seed=31)
    # one pool big enough for both: the graph reads through static block-table / seq-len buffers
    key_cache, value_cache = big.key_cache, big.value_cache
    query = small.query.clone()
    block_tables = torch.zeros_like(big.block_tables)
    block_tables[:, : small.block_tables.shape[1]] = small.block_tables
    seq_lens = small.seq_lens.clone()
    out = torch.empty_like(query)

    def step():  # the host's max_seq_len at capture time (5) must not limit the replay
        paged_attention_decode(query, key_cache, value_cache, block_tables, seq_lens, big.scale, out=out,
                               max_seq_len=5)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    query.copy_(big.query)
    block_tables.copy_(big.block_tables)
    seq_lens.copy_(big.seq_lens)
    graph.replay()
    torch.cuda.synchronize()
    _check(out, _ref(big))


def test_mixed_batch_decodes_first_through_both_kernels():
    seq_lens = [4099, 1, 777, 2048, 33, 1500]
    query_lens = [1, 1, 1, 2048, 0, 129]  # three decodes first, then a prefill, an idle row, a chunk
    pb = _batch(seq_lens, query_lens, 4, seed=60)
    out = paged_attention(
        pb.query, pb.key_cache, pb.value_cache, pb.block_tables, pb.query_start_loc, pb.seq_lens, pb.scale,
        max_seq_len=max(seq_lens), num_decodes=3,
    )
    _check(out, _ref(pb))
