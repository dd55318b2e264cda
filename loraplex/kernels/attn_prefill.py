"""Triton varlen paged attention: prefill, chunked prefill over a cached prefix, and mixed batches.

Semantics (twin: ``attention_ref.paged_attention_ref``)::

    for sequence b with L = query_start_loc[b+1] - query_start_loc[b] new tokens and N = seq_lens[b]
    keys (cached prefix + the new tokens, already stored in the cache), g = Hq // Hkv:
        new token i (0 <= i < L) sits at position p_i = N - L + i and
        out[query_start_loc[b] + i, h] = softmax_j(scale * q . K[j, h // g], j <= p_i) @ V[:, h // g]

Shape:
    query, out:               [T, Hq, D]   (T = query_start_loc[B])
    key_cache, value_cache:   [num_blocks, block_size, Hkv, D]
    block_tables:             [B, max_blocks_per_seq] int32
    query_start_loc:          [B + 1] int32
    seq_lens:                 [B] int32

Grid ``(T // BLOCK_Q + B, Hkv)``: sequence b owns query tiles ``query_start_loc[b] // BLOCK_Q + b + k``
for ``k < ceil(L / BLOCK_Q)`` (a bound computed from shapes alone, so no host-device sync); a program
finds its sequence by binary search over ``query_start_loc`` and exits when its tile is past the end.
Rows of a tile are (query token, head of the GQA group) pairs, ``BLOCK_M = BLOCK_Q * pow2(g)``, so each
K/V tile is read once per group. Keys run from position 0 to the tile's last query position; the
causal mask ``j <= p_i`` covers both the prefix and the new tokens.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels.attn_decode import LOG2E, accumulate_tile, check_kv_cache, dot_precision, kv_tile
from loraplex.kernels.host_math import cdiv, next_power_of_2
from loraplex.kernels.launch import fast_launch


@triton.jit
def _find_seq(query_start_loc_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr):
    """Largest b with query_start_loc[b] // BLOCK_Q + b <= tile."""
    lo = num_seqs * 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@fast_launch
@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])  # stride_bt: the step's block-table width
def _prefill_kernel(
    q_ptr,
    key_cache_ptr,
    value_cache_ptr,
    key_scale_ptr,  # INT8 cache: fp32 [num_blocks, block_size, Hkv] row scales (else unused)
    value_scale_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    out_ptr,
    qk_scale,  # scale * log2(e)
    num_seqs,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    block_size,
    GROUP: tl.constexpr,
    GROUP_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,  # BLOCK_Q * GROUP_P2 rows
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_INT8: tl.constexpr = False,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    b = _find_seq(query_start_loc_ptr, num_seqs, tile, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + b)
    q_len = tl.load(query_start_loc_ptr + b + 1) - q_start
    local = tile - (q_start // BLOCK_Q + b)
    if local * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    prefix_len = seq_len - q_len

    r = tl.arange(0, BLOCK_M)
    qi = local * BLOCK_Q + r // GROUP_P2  # index among the new tokens of b
    gh = r % GROUP_P2
    row_mask = (qi < q_len) & (gh < GROUP)
    heads = kv_head * GROUP + gh
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q_rows = (q_start + qi).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
        mask=row_mask[:, None] & d_mask[None, :], other=0.0,
    )
    q_pos = prefix_len + qi

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    kv_end = prefix_len + tl.minimum((local + 1) * BLOCK_Q, q_len)  # last query position + 1
    block_table_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    for tile_start in range(0, kv_end, BLOCK_N):
        t = tile_start + tl.arange(0, BLOCK_N)
        t_mask = t < kv_end
        s, v, v_scale = kv_tile(q, t, t_mask, d, d_mask, block_table_row, kv_head, key_cache_ptr, value_cache_ptr,
                                key_scale_ptr, value_scale_ptr, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
                                stride_vh, block_size, qk_scale, BLOCK_N, DOT_PRECISION, KV_INT8)
        s = tl.where(t_mask[None, :] & (t[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet: no -inf - -inf
        acc, l_i = accumulate_tile(acc, l_i, m_i, m_safe, s, v, v_scale, DOT_PRECISION, KV_INT8)
        m_i = m_new

    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
        o.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :],
    )


def paged_attention_varlen(
    query: torch.Tensor,  # [T, Hq, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks_per_seq] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32
    seq_lens: torch.Tensor,  # [B] int32
    scale: float,
    out: torch.Tensor | None = None,  # [T, Hq, D]
    block_m: int = 64,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    key_scale: torch.Tensor | None = None,  # INT8 cache: [num_blocks, block_size, Hkv] fp32 row scales
    value_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its paged KV (see module doc)."""
    num_tokens, num_q_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, cache_head_dim = key_cache.shape
    batch = seq_lens.shape[0]
    assert cache_head_dim == head_dim and value_cache.shape == key_cache.shape
    assert num_q_heads % num_kv_heads == 0, f"Hq {num_q_heads} not a multiple of Hkv {num_kv_heads}"
    assert query.stride(2) == 1 and key_cache.stride(3) == 1 and value_cache.stride(3) == 1
    int8 = check_kv_cache(query, key_cache, value_cache, key_scale, value_scale)
    assert block_tables.dtype == torch.int32 and block_tables.shape[0] == batch and block_tables.stride(1) == 1
    assert query_start_loc.dtype == torch.int32 and query_start_loc.shape == (batch + 1,)
    assert query_start_loc.is_contiguous() and seq_lens.is_contiguous()
    assert seq_lens.dtype == torch.int32
    if out is None:
        out = torch.empty_like(query)
    assert out.shape == query.shape and out.stride(2) == 1
    if num_tokens == 0 or batch == 0:
        return out
    group = num_q_heads // num_kv_heads
    group_p2 = next_power_of_2(group)
    block_q = max(1, block_m // group_p2)
    if block_q * group_p2 < 16:  # tl.dot needs >= 16 rows
        block_q = cdiv(16, group_p2)
    num_tiles = num_tokens // block_q + batch
    _prefill_kernel[(num_tiles, num_kv_heads)](
        query, key_cache, value_cache, key_scale if int8 else key_cache, value_scale if int8 else value_cache,
        block_tables, query_start_loc, seq_lens, out,
        scale * LOG2E, batch,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0), block_size,
        GROUP=group, GROUP_P2=group_p2, HEAD_DIM=head_dim,
        BLOCK_D=max(16, next_power_of_2(head_dim)), BLOCK_Q=block_q, BLOCK_M=block_q * group_p2,
        BLOCK_N=block_n, KV_INT8=int8, DOT_PRECISION=dot_precision(query.dtype),
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
