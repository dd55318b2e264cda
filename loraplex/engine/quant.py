"""Weight quantization of the base model (``EngineConfig.quantization``): INT8 or FP8 weight-only (W8A16).

After loading, the weights of every layer's four projections (q|k|v, o, gate|up, down) are replaced by 8-bit values
with one fp32 scale per output row: ``"int8"`` symmetric (s = max|w| / 127, q = round(w / s): at most half a step
of 1/127 of the row's largest weight), ``"fp8"`` float8 e4m3 (s = max|w| / 448: a relative error of at most 1/16
per weight, better for rows with a few large weights). The embeddings, the final norm and the LM head stay in the
model's dtype; activations, LoRA adapters, the KV cache and all accumulation keep their types, so the only error is
the weights' rounding.

On CUDA the projections run through ``kernels/w8a16.py`` (8-bit read, converted in registers, scale in the
epilogue); on the CPU through the twin, ``F.linear`` over the dequantized row-scaled weight, which is exactly what
a model whose weights are those dequantized values computes (the tests hold the engine to Hugging Face on such a
model). Weight memory: 1 byte per value + 4 per row, about half of bf16, so the KV cache gets the difference.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

FP8_MAX = 448.0  # largest float8 e4m3 value


@dataclass
class QuantizedWeight:
    """A weight-only quantized linear weight: ``qweight`` int8 or float8 e4m3 [N, K], ``scale`` fp32 [N]."""

    qweight: torch.Tensor
    scale: torch.Tensor
    scratch: torch.Tensor | None = None  # where large steps dequantize it (dequantize_into_scratch); not its bytes

    @property
    def shape(self) -> torch.Size:
        return self.qweight.shape

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.qweight.float() * self.scale[:, None]).to(dtype)  # int8 and e4m3 values are exact in fp32

    def nbytes(self) -> int:
        return self.qweight.numel() + 4 * self.scale.numel()


def _row_scales(w: torch.Tensor, qmax: float) -> torch.Tensor:
    """One scale per output row mapping its largest |w| to ``qmax`` (an all-zero row gets 1)."""
    scale = w.abs().amax(dim=1) / qmax
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def quantize_int8(weight: torch.Tensor) -> QuantizedWeight:
    """Per output row, symmetric: s = max|w| / 127 (an all-zero row gets s = 1), q = round(w / s) in [-127, 127]."""
    w = weight.detach().float()
    scale = _row_scales(w, 127.0)
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return QuantizedWeight(q.contiguous(), scale.contiguous())


def quantize_fp8(weight: torch.Tensor) -> QuantizedWeight:
    """Per output row: s = max|w| / 448 (an all-zero row gets s = 1), q = e4m3(w / s) (round to nearest even;
    |w / s| <= 448, so nothing saturates): 3 mantissa bits, relative error at most 1/16 per weight."""
    w = weight.detach().float()
    scale = _row_scales(w, FP8_MAX)
    q = (w / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return QuantizedWeight(q.contiguous(), scale.contiguous())


QUANTIZERS = {"int8": quantize_int8, "fp8": quantize_fp8}
QUANTIZATIONS = tuple(QUANTIZERS)


def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
           accumulate: bool = False) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a plain or a quantized weight; ``accumulate``: ``out += x @ W^T`` (bias
    not allowed then)."""
    if not isinstance(weight, QuantizedWeight):
        if accumulate:
            assert bias is None
            return out.addmm_(x, weight.t())
        return F.linear(x, weight, bias)
    if x.is_cuda and x.shape[0] >= DEQUANT_GEMM_MIN_ROWS:
        # a large step is compute-bound: the weight dequantized once into a scratch buffer (the twin's exact values),
        # then cuBLAS; the 8-bit kernel's per-tile conversion costs far more there (see DEQUANT_GEMM_MIN_ROWS)
        w = dequantize_into_scratch(weight, x.dtype)
        if accumulate:
            return out.addmm_(x, w.t())
        return F.linear(x, w, bias)
    if x.is_cuda:
        from loraplex.kernels.w8a16 import w8a16_linear

        if x.stride(-1) != 1:
            x = x.contiguous()
        return w8a16_linear(x, weight.qweight, weight.scale, bias, out=out, accumulate=accumulate)
    result = F.linear(x, weight.dequantize(x.dtype), bias)
    if accumulate:
        return out.add_(result)
    return result


# Steps of at least this many rows (CUDA) run a quantized projection as its dequantized weight and cuBLAS. On the H200
# (docs/benchmarks/H200-2026-12-03-run17.md) the W8A16 kernel made the steps with prompt tokens (~7,300 rows) of an
# offline run 27% (int8) and 91% (fp8) slower than bf16; the conversion moves ~7 bytes per weight (about 3.5 ms per
# such step on an 8B model) while the GEMM itself is compute-bound. Decode-sized steps keep the 8-bit kernel.
DEQUANT_GEMM_MIN_ROWS = int(os.environ.get("LORAPLEX_QUANT_DEQUANT_MIN_ROWS", "1024"))


def dequantize_into_scratch(weight: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """``weight.dequantize(dtype)`` written into ``weight.scratch`` (one flat buffer a model's weights share, sized by
    ``quantize_model_`` at load so CUDA-graph captures never allocate it; a weight without one gets its own): the
    8-bit values converted exactly (int8 and e4m3 values are exact in bf16 and fp16), then times the row scales
    computed in fp32 and rounded once, as the twin."""
    n, k = weight.shape
    buf = weight.scratch
    if buf is None or buf.dtype != dtype or buf.numel() < n * k:
        buf = weight.scratch = torch.empty(n * k, dtype=dtype, device=weight.qweight.device)
    w = buf[:n * k].view(n, k)
    w.copy_(weight.qweight)
    return w.mul_(weight.scale[:, None])


def quantize_model_(model, method: str) -> int:
    """Replace the projection weights of every layer of ``model`` (a ``LlamaForCausalLM``) in place; returns the
    bytes of weights freed."""
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {method!r}")
    freed = 0
    weights = []
    for layer in model.layers:
        for name in ("qkv_weight", "o_weight", "gate_up_weight", "down_weight"):
            weight = getattr(layer, name)
            quantized = QUANTIZERS[method](weight)
            freed += weight.numel() * weight.element_size() - quantized.nbytes()
            del layer._parameters[name]  # a Parameter's name cannot take another kind of value
            object.__setattr__(layer, name, quantized)
            weights.append(quantized)
    if model.embed_tokens.is_cuda and weights:  # the large-step path's buffer, shared, allocated now
        scratch = torch.empty(max(w.qweight.numel() for w in weights), dtype=model.embed_tokens.dtype,
                              device=model.embed_tokens.device)
        for w in weights:
            w.scratch = scratch
        freed -= scratch.numel() * scratch.element_size()
    return freed
