"""Pure-torch twins of ``loraplex.kernels.fused_ops`` (no Triton import: the CPU engine runs these)."""

from __future__ import annotations

import torch


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    hidden = residual + x
    return rms_norm_ref(hidden, weight, eps), hidden


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of ``x`` [T, H, D] with ``cos``/``sin`` [T, D] in x's dtype."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def rope_store_kv_ref(qkv, cos, sin, key_cache, value_cache, slot_mapping, num_heads: int, num_kv_heads: int,
                      head_dim: int) -> torch.Tensor:
    from loraplex.kernels.attention_ref import store_kv_ref

    t = qkv.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = rope_ref(q.view(t, num_heads, head_dim), cos, sin)
    k = rope_ref(k.view(t, num_kv_heads, head_dim), cos, sin)
    store_kv_ref(k, v.view(t, num_kv_heads, head_dim), key_cache, value_cache, slot_mapping)
    return q


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
