"""Weight-only 8-bit linear layers (W8A16) in Triton: ``out = x @ dequant(Wq)^T (+ bias)``.

Semantics (twin: ``w8a16_linear_ref``), with ``Wq`` int8 or float8 e4m3 [N, K] and one fp32 scale per output row::

    out[m, n] = cast(scale[n] * sum_k float32(x[m, k]) * float32(Wq[n, k]) + bias[n])        (fp32 accumulate)
    accumulate=True: out[m, n] = cast(float32(out[m, n]) + the same)                          (out read, then written)

The weights are read as 8-bit values (half the bytes of bf16: a decode step, bound by reading the weights, can go up to
twice as fast) and converted to the activations' dtype in registers; the scale is applied once per output in the
epilogue. Grid ``(cdiv(M, BLOCK_M), cdiv(N, BLOCK_N))``; each program loops over K.

Launch configurations (``choose_blocks``) come from an H200 sweep. Measured there: at 1-16 rows (small-batch decode)
the kernel beats cuBLAS bf16 by 1.05-1.55x; from 64 rows on it is slower (0.4-0.7x): the int8 -> bf16 conversion
of each weight tile feeding the tensor-core dot costs more than the bytes it saves. INT8/FP8 weights therefore
buy memory (half the weight bytes: a bigger KV cache), and speed only for small batches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels.host_math import cdiv


@triton.jit
def _w8a16_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr,
    M, N, K, K_PER_SPLIT,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_on, stride_os,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACCUMULATE: tl.constexpr, DOT_PRECISION: tl.constexpr, SPLIT_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    k_begin = pid_k * K_PER_SPLIT  # K_PER_SPLIT: a multiple of BLOCK_K (K itself when SPLIT_K == 1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + (k_begin + offs_k[None, :]) * stride_xk
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + (k_begin + offs_k[:, None]) * stride_wk  # [BK, BN]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K_PER_SPLIT, BLOCK_K):
        k_mask = (k_begin + k0 + offs_k) < K
        xt = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        wt = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc += tl.dot(xt, wt.to(xt.dtype), input_precision=DOT_PRECISION)  # int8 -> the activations' dtype: exact
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    acc = acc * tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
    o_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K > 1:
        # fp32 partial sums [SPLIT_K, M, N]; the wrapper adds them up (then bias, accumulate, cast)
        p_ptrs = out_ptr + pid_k * stride_os + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :] * stride_on
        tl.store(p_ptrs, acc, mask=o_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        o_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :] * stride_on
        if ACCUMULATE:
            acc += tl.load(o_ptrs, mask=o_mask, other=0.0).to(tl.float32)
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=o_mask)


LAUNCH_DEFAULTS = (4, 3, 1)  # num_warps, num_stages, split_k


def choose_blocks(m: int, n: int, k: int) -> tuple[int, ...]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, split_k) from the shapes (host values only), as the H200
    sweep at the Llama-3-8B projections chose them (docs/benchmarks/H200-2026-12-03-run16.md): decode-sized M
    takes narrow 256-deep tiles with a 4-stage pipeline (split-K for a long K, e.g. down's 14,336); 17-64 rows
    64-row tiles; more rows 128 x 128 tiles for wide outputs."""
    long_k, wide = k >= 8192, n >= 16384
    if m <= 16:
        return (16, 64, 256, 4, 3, 4) if long_k else (16, 64, 256, 4, 3, 1) if wide else (16, 32, 256, 4, 4, 1)
    if m <= 64:
        return (64, 64, 256, 4, 3, 2) if long_k else (64, 64, 128, 4, 4, 1) if wide else (64, 128, 128, 8, 3, 4)
    if m <= 256 and not wide:
        return 64, 64, 64, 4, 3, 1
    return 128, 128, 64, 8, 3, 1


def w8a16_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                 out: torch.Tensor | None = None, accumulate: bool = False,
                 blocks: tuple[int, ...] | None = None) -> torch.Tensor:
    """``x`` [M, K] (fp16 / bf16 / fp32), ``qweight`` int8 [N, K], ``scale`` fp32 [N], ``bias`` [N] or None;
    ``out`` [M, N] of x's dtype (written, or added to with ``accumulate``). ``blocks``: (BLOCK_M, BLOCK_N, BLOCK_K)
    and optionally num_warps, num_stages, split_k (default 4, 3, 1; split_k > 1 sums fp32 partials in a second
    op). See the module doc."""
    m, k = x.shape
    n, wk = qweight.shape
    assert wk == k, f"x has K={k}, the weight has K={wk}"
    assert qweight.dtype in (torch.int8, torch.float8_e4m3fn), f"qweight is {qweight.dtype}: int8 or float8 e4m3"
    assert scale.dtype == torch.float32 and scale.shape == (n,)
    assert not accumulate or out is not None, "accumulate needs out"
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    assert out.shape == (m, n) and out.dtype == x.dtype
    if m == 0:
        return out
    config = tuple(blocks or choose_blocks(m, n, k))
    bm, bn, bk, warps, stages, split_k = config + LAUNCH_DEFAULTS[len(config) - 3:]
    k_per_split = cdiv(cdiv(k, split_k), bk) * bk
    split_k = cdiv(k, k_per_split)
    target = out if split_k == 1 else torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
    _w8a16_kernel[(cdiv(m, bm), cdiv(n, bn), split_k)](
        x, qweight, scale, bias if bias is not None else scale, target,
        m, n, k, k_per_split,
        x.stride(0), x.stride(1), qweight.stride(0), qweight.stride(1), target.stride(-2), target.stride(-1),
        target.stride(0) if split_k > 1 else 0,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, HAS_BIAS=bias is not None, ACCUMULATE=accumulate,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", SPLIT_K=split_k,
        num_warps=warps, num_stages=stages,
    )
    if split_k > 1:
        acc = target.sum(0)
        if bias is not None:
            acc += bias.float()
        if accumulate:
            acc += out.float()
        out.copy_(acc)
    return out


def w8a16_linear_ref(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """The twin: fp32 products and sums, the scale per output, then the bias; cast to x's dtype."""
    acc = (x.float() @ qweight.float().t()) * scale
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(x.dtype)
