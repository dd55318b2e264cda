"""Paged attention entry points (Triton, CUDA): decode and varlen prefill / chunked prefill / mixed.

Semantics: exactly ``attention_ref.paged_attention_ref`` (the CPU path and the test twin)::

    for sequence b with L new tokens (query_start_loc[b] .. query_start_loc[b+1]) and N = seq_lens[b]
    keys in the cache (prefix + new tokens), new token i at position N - L + i, g = Hq // Hkv:
        out[i, h] = softmax_j(scale * q[i, h] . K[j, h // g], j <= N - L + i) @ V[:, h // g]

Shape:
    query, out:               [T, Hq, D]
    key_cache, value_cache:   [num_blocks, block_size, Hkv, D]
    block_tables:             [B, max_blocks_per_seq] int32
    query_start_loc:          [B + 1] int32
    seq_lens:                 [B] int32

Kernels: ``attn_decode`` (one new token per sequence, split-KV) and ``attn_prefill`` (any lengths).
The caller tells which one applies through ``max_query_len`` (it knows the lengths on the host), so
dispatch never reads device memory.
"""

from __future__ import annotations

import torch

from loraplex.kernels.attn_decode import choose_num_splits, paged_attention_decode
from loraplex.kernels.attn_prefill import paged_attention_varlen

__all__ = ["choose_num_splits", "paged_attention", "paged_attention_decode", "paged_attention_varlen"]


def paged_attention(
    query: torch.Tensor,  # [T, Hq, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks_per_seq] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32
    seq_lens: torch.Tensor,  # [B] int32
    scale: float,
    out: torch.Tensor | None = None,  # [T, Hq, D]
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    num_decodes: int = 0,
    rest_query_start_loc: torch.Tensor | None = None,
    rest_seq_lens: torch.Tensor | None = None,
    rest_block_tables: torch.Tensor | None = None,
    key_scale: torch.Tensor | None = None,  # an INT8 cache's row scales [num_blocks, block_size, Hkv] fp32
    value_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal paged attention of the new tokens (see module doc).

    ``max_query_len == 1`` (every sequence has exactly one new token, so ``T == B``) runs the split-KV
    decode kernel on the whole batch. In a mixed batch whose first ``num_decodes`` sequences have exactly
    one new token each (decodes first, as the caller orders them), those run through the decode kernel and
    the rest through the varlen kernel, so decode rows do not fill 16-row query tiles alone. Otherwise
    (``None`` = unknown) the varlen kernel runs everything, which is correct for every case.
    ``max_seq_len`` (optional, host int) only tunes the decode split count. ``rest_query_start_loc``
    (optional) is ``query_start_loc[num_decodes:] - num_decodes``, made once per step by a caller that runs
    every layer with the same metadata; ``rest_seq_lens`` / ``rest_block_tables`` (optional) are
    ``seq_lens[num_decodes:]`` / ``block_tables[num_decodes:]`` as tensors of their own: a slice starts 4 bytes
    per row in, and Triton compiles a variant per 16-byte alignment of a pointer argument. No host-device sync.
    """
    num_tokens = query.shape[0]
    batch = seq_lens.shape[0]
    if max_query_len == 1:
        assert num_tokens == batch, f"max_query_len=1 needs one token per sequence: T={num_tokens}, B={batch}"
        num_decodes = batch
    assert 0 <= num_decodes <= min(batch, num_tokens), f"num_decodes {num_decodes} outside [0, {batch}]"
    if num_decodes == 0:
        return paged_attention_varlen(
            query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale, out=out,
            key_scale=key_scale, value_scale=value_scale,
        )
    if out is None:
        out = torch.empty_like(query)
    d = num_decodes
    paged_attention_decode(query[:d], key_cache, value_cache, block_tables[:d], seq_lens[:d], scale,
                           out=out[:d], max_seq_len=max_seq_len, key_scale=key_scale, value_scale=value_scale)
    if d < batch:
        # the remaining sequences' tokens start right after the d decode rows
        if rest_query_start_loc is None:
            rest_query_start_loc = query_start_loc[d:] - d
        paged_attention_varlen(query[d:], key_cache, value_cache,
                               block_tables[d:] if rest_block_tables is None else rest_block_tables,
                               rest_query_start_loc, seq_lens[d:] if rest_seq_lens is None else rest_seq_lens, scale,
                               out=out[d:], key_scale=key_scale, value_scale=value_scale)
    return out
