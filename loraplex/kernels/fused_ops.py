"""Fused element-wise kernels of a Llama layer: one launch where eager torch needs five to ten.

A decode step at batch 64 is a few hundred kilobytes of activations per layer; what costs time there is
not bytes but the number of kernels (each a few microseconds of launch and tail latency, even inside a
CUDA graph). Eager torch spends ~35 kernels per layer on RMSNorm (float cast, pow, mean, add, rsqrt, two
multiplies, cast back), rotate-half RoPE (slices, negation, concatenation, multiplies, add), the KV store,
SiLU-and-multiply and the residual adds. These kernels do the same math in four launches per layer:

``rms_norm(x, w, eps)``                      -> w * norm(x)
``add_rms_norm(x, residual, w, eps)``        -> (w * norm(residual + x), residual + x)
``rope_store_kv(qkv, cos, sin, ...)``        -> RoPE(q) as a new [T, Hq, D] tensor; RoPE(k) and v written into
                                                the paged KV cache through the slot mapping (-1 = skip)
``silu_mul(gate_up)``                        -> silu(gate) * up

Each rounds where Hugging Face's float32/bfloat16 modules round (the residual add and every RoPE and
SiLU product in the activation dtype, the norm in float32 then cast before the weight), so bf16 results
equal eager torch's bit for bit in most elements and within one bf16 ulp elsewhere. Pure-torch twins
(``*_ref``) define the semantics; the model uses them on the CPU.

One program per token row; rows are at most a few thousand elements (hidden 4096-8192, q heads x D),
loaded in one block. No atomics, no bf16 dot: the kernels run under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels.fp8 import round_to_e4m3
from loraplex.kernels.fused_ops_ref import (  # noqa: F401 (the twins, re-exported next to their kernels)
    add_rms_norm_ref,
    rms_norm_ref,
    rope_ref,
    rope_store_kv_ref,
    silu_mul_ref,
)
from loraplex.kernels.host_math import cdiv, next_power_of_2
from loraplex.kernels.launch import fast_launch

# ---- kernels --------------------------------------------------------------------------------------------


@fast_launch
@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_res, stride_out,
                     stride_res_out, n_cols, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        x = (r.to(tl.float32) + x.to(tl.float32)).to(x_ptr.dtype.element_ty)  # rounded as torch's add
        tl.store(res_out_ptr + row * stride_res_out + cols, x, mask=mask)
    h = x.to(tl.float32)
    var = tl.sum(h * h, axis=0) / n_cols
    h = (h * tl.rsqrt(var + eps)).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = w.to(tl.float32) * h.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _launch_norm(x, residual, weight, eps):
    assert x.dim() == 2 and x.stride(-1) == 1, "rows must be contiguous"
    n_rows, n_cols = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else out
    res = residual if residual is not None else x
    if n_rows:
        _rms_norm_kernel[(n_rows,)](
            x, res, weight, out, res_out, x.stride(0), res.stride(0), out.stride(0), res_out.stride(0), n_cols,
            eps, HAS_RESIDUAL=residual is not None, BLOCK=next_power_of_2(n_cols),
            num_warps=_warps(n_cols))
    return out, res_out


def _warps(n: int) -> int:
    return 4 if n <= 2048 else 8 if n <= 8192 else 16


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch_norm(x, None, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(norm(residual + x) * weight, residual + x) in one launch; neither input is modified."""
    assert residual.shape == x.shape and residual.stride(-1) == 1
    return _launch_norm(x, residual, weight, eps)


@triton.jit
def _rope_rows(src, cos_row, sin_row, h, d, HALF: tl.constexpr, mask):
    """RoPE of the heads ``h`` at dims ``d`` of one token, rounded like the eager twin."""
    x = tl.load(src + h * (2 * HALF) + d, mask=mask, other=0.0)
    partner = tl.where(d < HALF, d + HALF, d - HALF)
    xp = tl.load(src + h * (2 * HALF) + partner, mask=mask, other=0.0)
    rot = tl.where(d < HALF, -xp.to(tl.float32), xp.to(tl.float32)).to(x.dtype)
    c = tl.load(cos_row + d, mask=mask, other=0.0)
    s = tl.load(sin_row + d, mask=mask, other=0.0)
    a = (x.to(tl.float32) * c.to(tl.float32)).to(x.dtype)
    b = (rot.to(tl.float32) * s.to(tl.float32)).to(x.dtype)
    return (a.to(tl.float32) + b.to(tl.float32)).to(x.dtype)


@fast_launch
@triton.jit
def _rope_store_kernel(qkv_ptr, cos_ptr, sin_ptr, q_out_ptr, key_cache_ptr, value_cache_ptr, slot_ptr,
                       stride_qkv, stride_cos, stride_sin, block_size, stride_cache_block, stride_cache_slot,
                       NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                       Q_BLOCK: tl.constexpr, KV_BLOCK: tl.constexpr, FP8: tl.constexpr = False):
    t = tl.program_id(0).to(tl.int64)
    HALF: tl.constexpr = HEAD_DIM // 2
    row = qkv_ptr + t * stride_qkv
    cos_row = cos_ptr + t * stride_cos
    sin_row = sin_ptr + t * stride_sin
    # q: every head of this token
    i = tl.arange(0, Q_BLOCK)
    qmask = i < NUM_HEADS * HEAD_DIM
    q = _rope_rows(row, cos_row, sin_row, i // HEAD_DIM, i % HEAD_DIM, HALF, qmask)
    tl.store(q_out_ptr + t * (NUM_HEADS * HEAD_DIM) + i, q, mask=qmask)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        j = tl.arange(0, KV_BLOCK)
        kvmask = j < NUM_KV_HEADS * HEAD_DIM
        k = _rope_rows(row + NUM_HEADS * HEAD_DIM, cos_row, sin_row, j // HEAD_DIM, j % HEAD_DIM, HALF, kvmask)
        v = tl.load(row + (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM + j, mask=kvmask, other=0.0)
        dst = (slot // block_size) * stride_cache_block + (slot % block_size) * stride_cache_slot + j
        if FP8:  # float8 e4m3 cache (scale 1): saturate at +-448
            k = round_to_e4m3(k).to(k.dtype)  # e4m3 values are exact in 16 bits
            v = round_to_e4m3(v).to(v.dtype)
        tl.store(key_cache_ptr + dst, k.to(key_cache_ptr.dtype.element_ty), mask=kvmask)
        tl.store(value_cache_ptr + dst, v.to(value_cache_ptr.dtype.element_ty), mask=kvmask)


def rope_store_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, key_cache: torch.Tensor,
                  value_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int,
                  head_dim: int) -> torch.Tensor:
    """RoPE on q and k of ``qkv`` [T, (Hq + 2 Hkv) * D]; k and v go into the cache, q is returned [T, Hq, D]."""
    t = qkv.shape[0]
    assert qkv.stride(-1) == 1 and qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim
    assert cos.stride(-1) == 1 and sin.stride(-1) == 1 and head_dim % 2 == 0
    assert key_cache.is_contiguous() and value_cache.is_contiguous()
    assert key_cache.shape[2:] == (num_kv_heads, head_dim)
    q = torch.empty(t, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if t:
        q_block = next_power_of_2(num_heads * head_dim)
        _rope_store_kernel[(t,)](
            qkv, cos, sin, q, key_cache, value_cache, slot_mapping, qkv.stride(0), cos.stride(0), sin.stride(0),
            key_cache.shape[1], key_cache.stride(0), key_cache.stride(1), NUM_HEADS=num_heads,
            NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, Q_BLOCK=q_block,
            KV_BLOCK=next_power_of_2(num_kv_heads * head_dim), FP8=key_cache.dtype == torch.float8_e4m3fn,
            num_warps=_warps(q_block))
    return q


@triton.jit
def silu_mul_values(g, u):
    """silu(g) * u in g's dtype, rounded as torch: silu in float32 rounded once, then the product rounded (shared
    with the down shrink folded into SiLU-and-multiply, lora_fold.py, so both compute the same bits)."""
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    return (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype)


@triton.jit
def silu_mul_block(x_ptr, out_ptr, row, col_block, stride_x, stride_out, n_cols, BLOCK: tl.constexpr):
    """out[row, cols] = silu(gate) * up for the BLOCK columns of block ``col_block`` of one row of gate|up
    (shared with the row programs of the down shrink folded into SiLU-and-multiply, lora_fold.py)."""
    cols = col_block * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    u = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_out + cols, silu_mul_values(g, u).to(out_ptr.dtype.element_ty), mask=mask)


@fast_launch
@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, n_cols, BLOCK: tl.constexpr):
    silu_mul_block(x_ptr, out_ptr, tl.program_id(0).to(tl.int64), tl.program_id(1), stride_x, stride_out, n_cols,
                   BLOCK)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of ``gate_up`` [T, 2I] (gate first) -> [T, I]."""
    assert gate_up.dim() == 2 and gate_up.stride(-1) == 1 and gate_up.shape[1] % 2 == 0
    t, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(t, n, dtype=gate_up.dtype, device=gate_up.device)
    if t:
        block = min(4096, next_power_of_2(n))
        _silu_mul_kernel[(t, cdiv(n, block))](gate_up, out, gate_up.stride(0), out.stride(0), n,
                                              BLOCK=block, num_warps=_warps(block))
    return out
