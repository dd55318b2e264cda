"""Random paged-attention inputs for tests and benchmarks (no Triton import here).

``make_paged_batch`` lays the K/V of each sequence over blocks in random order (the whole pool is
filled with random values, so a kernel that reads a wrong block or past a sequence's end shows up).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraplex.kernels.attention_ref import quantize_int8_rows, to_cache_dtype


@dataclass
class PagedBatch:
    query: torch.Tensor  # [T, Hq, D]
    key_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    scale: float
    key_scale: torch.Tensor | None = None  # an INT8 cache's row scales [num_blocks, block_size, Hkv]
    value_scale: torch.Tensor | None = None

    @property
    def scales(self) -> dict:
        """The keyword arguments that pass the scales to a kernel or twin (empty unless INT8)."""
        return {} if self.key_scale is None else {"key_scale": self.key_scale, "value_scale": self.value_scale}

    @property
    def max_query_len(self) -> int:
        return int((self.query_start_loc[1:] - self.query_start_loc[:-1]).max().item())


def make_paged_batch(
    seq_lens: list[int],
    query_lens: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    spare_blocks: int = 3,
    shuffle: bool = True,
    kv_dtype: torch.dtype | None = None,
) -> PagedBatch:
    """Sequence b has ``seq_lens[b]`` keys, the last ``query_lens[b]`` of them new (queried); the cache is
    ``kv_dtype`` (default ``dtype``; float8 e4m3 as the engine stores it, saturating)."""
    assert len(seq_lens) == len(query_lens)
    assert all(0 <= q <= n for q, n in zip(query_lens, seq_lens))
    gen = torch.Generator(device="cpu").manual_seed(seed)
    blocks_per_seq = [(n + block_size - 1) // block_size for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    order = torch.randperm(num_blocks, generator=gen) if shuffle else torch.arange(num_blocks)
    max_blocks = max(1, max(blocks_per_seq, default=1))
    # unused table entries point at a real block (a kernel must not read them at all)
    block_tables = torch.full((len(seq_lens), max_blocks), int(order[-1]), dtype=torch.int32)
    used = 0
    for b, nb in enumerate(blocks_per_seq):
        block_tables[b, :nb] = order[used : used + nb].to(torch.int32)
        used += nb
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    key_cache = torch.randn(shape, generator=gen).to(dtype)
    value_cache = torch.randn(shape, generator=gen).to(dtype)
    key_scale = value_scale = None
    if kv_dtype == torch.int8:  # per (token, head) row, as the engine stores it
        (key_cache, key_scale), (value_cache, value_scale) = map(quantize_int8_rows, (key_cache, value_cache))
        key_scale, value_scale = key_scale.to(device), value_scale.to(device)
    else:
        key_cache, value_cache = to_cache_dtype(key_cache, kv_dtype), to_cache_dtype(value_cache, kv_dtype)
    num_tokens = sum(query_lens)
    query = torch.randn((num_tokens, num_q_heads, head_dim), generator=gen).to(dtype)
    query_start_loc = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.tensor(query_lens, dtype=torch.int32).cumsum(0)
    return PagedBatch(
        query=query.to(device),
        key_cache=key_cache.to(device),
        value_cache=value_cache.to(device),
        block_tables=block_tables.to(device),
        query_start_loc=query_start_loc.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(device),
        scale=head_dim**-0.5,
        key_scale=key_scale,
        value_scale=value_scale,
    )
