"""Pure-torch reference twins for the paged-attention kernels (and the CPU path of the engine).

KV cache layout (per layer): ``key_cache``/``value_cache`` are ``[num_blocks, block_size, num_kv_heads,
head_dim]``. A sequence's KV lives in the blocks listed by its row of ``block_tables``; token ``t`` of a
sequence sits in block ``block_tables[b, t // block_size]`` at offset ``t % block_size``. The engine
addresses a cache slot as ``slot = block_id * block_size + offset``. The cache may be float8 e4m3
(``EngineConfig.kv_cache_dtype="fp8"``, scale 1): stores saturate at +-448, reads convert to fp32.
"""

from __future__ import annotations

import torch


def store_kv_ref(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int, -1 = do not store (padding)
    key_scale: torch.Tensor | None = None,  # [num_blocks, block_size, Hkv] fp32: an INT8 cache's row scales
    value_scale: torch.Tensor | None = None,
) -> None:
    """Semantics: for t with slot_mapping[t] = s >= 0:
    key_cache[s // block_size, s % block_size] = key[t]; value_cache[...] = value[t]. An INT8 cache stores each
    (token, KV head) row as ``quantize_int8_rows`` gives it, its scale into ``key_scale``/``value_scale``."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    num_blocks, block_size = key_cache.shape[:2]
    flat_k = key_cache.view(num_blocks * block_size, *key_cache.shape[2:])
    flat_v = value_cache.view(num_blocks * block_size, *value_cache.shape[2:])
    if key_cache.dtype == torch.int8:
        for x, flat, scales in ((key[valid], flat_k, key_scale), (value[valid], flat_v, value_scale)):
            q, s = quantize_int8_rows(x)
            flat[slots] = q
            scales.view(num_blocks * block_size, -1)[slots] = s
        return
    flat_k[slots] = to_cache_dtype(key[valid], key_cache.dtype)
    flat_v[slots] = to_cache_dtype(value[valid], value_cache.dtype)


def quantize_int8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [..., D] as int8 rows with one fp32 scale per row: s = max|x| / 127, q = round(x * (1 / s)) (ties to
    even); an all-zero row gets s = 0. The twin of ``kernels/fp8.quantize_int8_rows``."""
    x = x.float()
    s = x.abs().amax(-1) / 127.0
    inv = torch.where(s > 0, 1.0 / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(s))
    q = torch.round(x * inv[..., None]).clamp(-127, 127).to(torch.int8)
    return q, s


FP8_MAX = 448.0  # largest finite float8 e4m3fn


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as the cache stores it: float8 e4m3 saturates at +-448 (a plain cast may give NaN past it)."""
    if dtype == torch.float8_e4m3fn:
        return x.float().clamp(-FP8_MAX, FP8_MAX).to(dtype)
    return x.to(dtype)


def paged_attention_ref(
    query: torch.Tensor,  # [T, Hq, D]: the new tokens of all sequences, concatenated
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks_per_seq] int
    query_start_loc: torch.Tensor,  # [B + 1] int, cumulative query lengths
    seq_lens: torch.Tensor,  # [B] int, KV length of each sequence INCLUDING its new tokens
    scale: float,
    out: torch.Tensor | None = None,  # [T, Hq, D]
    key_scale: torch.Tensor | None = None,  # INT8 cache: [num_blocks, block_size, Hkv] fp32 row scales
    value_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole paged KV (cached prefix + new).

    Semantics, for sequence b with L = query_start_loc[b+1] - query_start_loc[b] new tokens and
    N = seq_lens[b] keys: new token i sits at position p_i = N - L + i, and with g = Hq // Hkv
    (query head h reads KV head h // g)::

        out[i, h] = softmax_j(scale * q[i, h] . K[j, h // g]  for j <= p_i) @ V[:, h // g]

    computed in float32 and returned in the query's dtype. Decode is the case L = 1.
    """
    num_tokens, num_q_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_q_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for b, n in enumerate(lens):
        q_start, q_end = starts[b], starts[b + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        num_blocks = (n + block_size - 1) // block_size
        blocks = block_tables[b, :num_blocks].long()
        k = key_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:n].float()  # [N, Hkv, D]
        v = value_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:n].float()
        if key_scale is not None:  # INT8: each (token, head) row times its scale
            k = k * key_scale[blocks].reshape(-1, num_kv_heads)[:n, :, None]
            v = v * value_scale[blocks].reshape(-1, num_kv_heads)[:n, :, None]
        q = query[q_start:q_end].float().view(q_len, num_kv_heads, group, head_dim)
        scores = torch.einsum("lkgd,nkd->kgln", q, k) * scale  # [Hkv, g, L, N]
        q_pos = torch.arange(n - q_len, n, device=query.device)
        kv_pos = torch.arange(n, device=query.device)
        scores.masked_fill_(kv_pos[None, :] > q_pos[:, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        o = torch.einsum("kgln,nkd->lkgd", probs, v)  # [L, Hkv, g, D]
        out[q_start:q_end] = o.reshape(q_len, num_q_heads, head_dim).to(out.dtype)
    return out
