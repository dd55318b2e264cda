"""The o or down LoRA expand folded into the residual add + RMSNorm that follows it (decode-sized steps).

In a decode step every LoRA launch carries a fixed latency of a few microseconds (docs/benchmarks/NOTES-lora.md),
and the expands of o and down move little (B of the step's adapters: 128 KB each at rank 16 for 4,096 columns)
but run at about a third of the copy bandwidth. Their output goes straight into the residual add + RMSNorm,
a row-wise kernel that reads that row anyway. Here each row's program adds its own adapter's delta to the row
while it reads it: one launch fewer per projection, and the projection output is never rewritten.

Semantics (twin: ``lora_add_rms_norm_ref``), token t with slot l = token_slots[t] and rank r = ranks[0, l]:

    h[t, n]  = cast(float32(x[t, n]) + scaling[l] * sum_{j < r} y_t[j] * B[l, j, n])   (l >= 0 and r > 0)
             = x[t, n]                                                                (otherwise)
    res[t]   = cast(float32(residual[t]) + float32(h[t]))
    out[t]   = rmsnorm(res[t]) * weight

with ``y_t[j] = sum_p y[p, 0, t, j]`` (the shrink's valid split-K partials, or the in-GEMM shrink's columns of the
token's slot, ``y_slot_stride``; rounded to B's dtype as the expand
kernel rounds them), i.e. the expand into x (``lora_expand``) then ``add_rms_norm``, up to the summation order.
x and residual are not modified.

One program per row: every row reads its adapter's whole B. That is what a decode step of distinct adapters reads
anyway; rows that share an adapter re-read it from L2, so large steps (prefill) keep the separate expand.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels.host_math import next_power_of_2
from loraplex.kernels.launch import fast_launch
from loraplex.kernels.lora_meta import LoRAKernelMeta
from loraplex.kernels.lora_shrink import num_chunks_of, split_parts

UNSPECIALIZED = ("shrink_progs", "k_tiles", "stride_yp", "stride_yt")


@fast_launch
@triton.jit(do_not_specialize=UNSPECIALIZED)
def _lora_add_rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, y_ptr, b_ptr, ranks_ptr, scaling_ptr, token_slots_ptr,
    num_chunks_ptr, shrink_progs, k_tiles, n_cols, eps,
    stride_x, stride_res, stride_out, stride_res_out, stride_yp, stride_yt, stride_yl, stride_bl, stride_br,
    SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, BLOCK_R: tl.constexpr, R_STEP: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    slot = tl.load(token_slots_ptr + row)
    rank = tl.load(ranks_ptr + tl.maximum(slot, 0))
    if (slot >= 0) & (rank > 0):
        parts, _ = split_parts(shrink_progs, tl.load(num_chunks_ptr), SPLIT_K, k_tiles)
        offs_j = tl.arange(0, R_STEP)
        b_row = b_ptr + slot.to(tl.int64) * stride_bl
        y_row = y_ptr + row * stride_yt + slot.to(tl.int64) * stride_yl
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for r0 in tl.static_range(0, BLOCK_R, R_STEP):
            j = r0 + offs_j
            j_mask = j < rank
            yj = tl.load(y_row + j, mask=j_mask, other=0.0)
            for p in tl.static_range(1, SPLIT_K):
                p_mask = (offs_j * 0 + p) < parts  # a tensor compare: the interpreter rejects a scalar-broadcast mask
                yj += tl.load(y_row + p * stride_yp + j, mask=j_mask & p_mask, other=0.0)
            yj = yj.to(b_ptr.dtype.element_ty).to(tl.float32)  # as the expand kernel rounds y before its dot
            b = tl.load(b_row + j[:, None].to(tl.int64) * stride_br + cols[None, :],
                        mask=j_mask[:, None] & mask[None, :], other=0.0)
            acc += tl.sum(b.to(tl.float32) * yj[:, None], axis=0)
        scale = tl.load(scaling_ptr + slot)
        x = (x.to(tl.float32) + acc * scale).to(x_ptr.dtype.element_ty)
    r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
    h = (r.to(tl.float32) + x.to(tl.float32)).to(x_ptr.dtype.element_ty)  # rounded as torch's add
    tl.store(res_out_ptr + row * stride_res_out + cols, h, mask=mask)
    hf = h.to(tl.float32)
    var = tl.sum(hf * hf, axis=0) / n_cols
    normed = (hf * tl.rsqrt(var + eps)).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_out + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty),
             mask=mask)


def lora_add_rms_norm(
    x: torch.Tensor,  # [T, N]: the projection's base output (not modified)
    residual: torch.Tensor,  # [T, N] (not modified)
    weight: torch.Tensor,  # [N]: the norm's weight
    eps: float,
    y: torch.Tensor,  # [SPLIT_K, 1, T, R] float32 partials of the shrink (or one [1, 1, T, R] view, see y_slot_stride)
    lora_b: torch.Tensor,  # [num_slots, R, N]
    ranks: torch.Tensor,  # [1, num_slots] int32
    scaling: torch.Tensor,  # [num_slots] float32
    meta: LoRAKernelMeta,
    *,
    shrink_progs: int | None = None,  # the shrink's ``progs`` and K tiles: which partials of y are valid;
    k_tiles: int | None = None,  # None: all y.shape[0] of them
    y_slot_stride: int = 0,  # > 0: each token's y sits at y[0, 0, t, slot * y_slot_stride + j] (the in-GEMM shrink's
    # view of every slot's y, ``LoRAStep(gemm_shrink=True)``; y may then be in the model's dtype)
    r_step: int = 4,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(residual + x + delta) * weight, residual + x + delta) (semantics in the module docstring)."""
    num_tokens, n_cols = x.shape
    split_k, num_slices, y_tokens, max_rank = y.shape
    num_slots, b_rank, b_cols = lora_b.shape
    assert num_slices == 1, "one slice (o or down)"
    assert y_tokens == num_tokens and b_rank == max_rank and b_cols == n_cols
    assert x.stride(1) == 1 and residual.shape == x.shape and residual.stride(1) == 1
    assert lora_b.stride(2) == 1 and lora_b.dtype == x.dtype and weight.shape == (n_cols,)
    assert (y.dtype == torch.float32 or y_slot_stride) and y.stride(3) == 1 and scaling.dtype == torch.float32
    assert not y_slot_stride or split_k == 1, "the in-GEMM shrink's y has one part"
    assert ranks.shape == (1, num_slots) and ranks.dtype == torch.int32
    assert meta.num_tokens == num_tokens and meta.num_slots == num_slots
    assert (shrink_progs is None) == (k_tiles is None), "shrink_progs and k_tiles come together"
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # x may be a strided view (the in-GEMM shrink's)
    res_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out, res_out
    if shrink_progs is None:
        shrink_progs, k_tiles = split_k * meta.max_chunks, split_k
    block_r = max(16, next_power_of_2(max_rank))
    r_step = min(next_power_of_2(max(1, r_step)), block_r)
    if num_warps is None:
        num_warps = 8 if n_cols <= 8192 else 16
    _lora_add_rms_norm_kernel[(num_tokens,)](
        x, residual, weight, out, res_out, y, lora_b, ranks, scaling, meta.token_slots, num_chunks_of(meta),
        shrink_progs, k_tiles, n_cols, eps,
        x.stride(0), residual.stride(0), out.stride(0), res_out.stride(0), y.stride(0), y.stride(2), y_slot_stride,
        lora_b.stride(0), lora_b.stride(1),
        SPLIT_K=split_k, BLOCK=next_power_of_2(n_cols), BLOCK_R=block_r, R_STEP=r_step, num_warps=num_warps,
    )
    return out, res_out


def lora_add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                          y: torch.Tensor, lora_b: torch.Tensor, token_slots: torch.Tensor, ranks: torch.Tensor,
                          scaling: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Twin: the expand into a copy of x (``lora_expand_ref``; y [1, T, R], partials summed), then
    ``add_rms_norm_ref``."""
    from loraplex.kernels.fused_ops_ref import add_rms_norm_ref
    from loraplex.kernels.lora_ref import lora_expand_ref

    h = lora_expand_ref(y, lora_b, token_slots, ranks, scaling, [0, x.shape[1]], x.clone())
    return add_rms_norm_ref(h, residual, weight, eps)
