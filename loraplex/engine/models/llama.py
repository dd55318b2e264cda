"""The Llama family over a paged KV cache: Llama 2/3 (rope scaling ``llama3``/``linear``), Mistral, Qwen2
(qkv bias). GQA and MQA; q|k|v and gate|up fused at load. Mirrors Hugging Face's math (RMSNorm in float32,
rotate-half RoPE computed in float32) so float32 results match it token for token.

LoRA hook: with ``lora`` (a ``LoRAStep``) each projection is ``lora.linear(layer_idx, proj, x, weight, bias)``
with ``proj`` in ``"qkv" | "o" | "gate_up" | "down"``: the base GEMM plus every token's adapter delta.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from loraplex.engine import quant
from loraplex.kernels import fused_ops_ref as fo

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


@dataclass
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    sliding_window: int | None

    @classmethod
    def from_hf(cls, cfg: dict) -> LlamaConfig:
        arch = (cfg.get("architectures") or ["?"])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported (only silu)")
        heads = cfg["num_attention_heads"]
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        is_qwen2 = arch == "Qwen2ForCausalLM"
        attention_bias = bool(cfg.get("attention_bias", False))
        window = cfg.get("sliding_window")
        if is_qwen2 and not cfg.get("use_sliding_window", False):
            window = None
        return cls(
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"], num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=float(theta),
            rope_scaling=rope if rope_type != "default" else None,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=is_qwen2 or attention_bias, o_bias=attention_bias and not is_qwen2,
            mlp_bias=bool(cfg.get("mlp_bias", False)), sliding_window=window,
        )


def rope_inv_freq(cfg: LlamaConfig) -> torch.Tensor:
    """Per-pair inverse frequencies [D/2] in float32, with Hugging Face's rope scaling rules."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope scaling {rope_type!r} is not supported (supported: linear, llama3)")


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def fused_ops_default(device) -> bool:
    """Triton element-wise kernels on CUDA (``LORAPLEX_FUSED_OPS=0`` turns them off, for A/B runs)."""
    return torch.device(device).type == "cuda" and os.environ.get("LORAPLEX_FUSED_OPS", "1") != "0"


class _Ops:
    """The layer's element-wise steps: the Triton kernels of ``loraplex.kernels.fused_ops`` or their twins."""

    def __init__(self, fused: bool):
        if fused:
            from loraplex.kernels import fused_ops as k

            self.rms_norm, self.add_rms_norm = k.rms_norm, k.add_rms_norm
            self.silu_mul = k.silu_mul

            def rope_store_kv(qkv, cos, sin, kv, attn, num_heads, num_kv_heads, head_dim):
                if kv.key_scale is not None:  # INT8: RoPE here, then the backend's quantizing store
                    return self._rope_then_store(qkv, cos, sin, kv, attn, num_heads, num_kv_heads, head_dim)
                return k.rope_store_kv(qkv, cos, sin, kv.key, kv.value, attn.slot_mapping, num_heads,
                                       num_kv_heads, head_dim)

            self.rope_store_kv = rope_store_kv
        else:
            self.rms_norm, self.add_rms_norm = fo.rms_norm_ref, fo.add_rms_norm_ref
            self.rope_store_kv, self.silu_mul = self._rope_then_store, fo.silu_mul_ref

    @staticmethod
    def _rope_then_store(qkv, cos, sin, kv, attn, num_heads, num_kv_heads, head_dim):
        """The twin path: torch RoPE, then the attention backend's KV store (its Triton kernel on CUDA, which
        CUDA graphs can capture: the reference store selects rows with a host-synchronizing mask)."""
        t = qkv.shape[0]
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = fo.rope_ref(q.view(t, num_heads, head_dim), cos, sin)
        k = fo.rope_ref(k.view(t, num_kv_heads, head_dim), cos, sin)
        attn.backend.store_kv(k, v.view(t, num_kv_heads, head_dim), kv, attn.slot_mapping)
        return q


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, device, dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, device=device, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fo.rms_norm_ref(x, self.weight, self.eps)


def _param(*shape, device, dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, device=device, dtype=dtype), requires_grad=False)


def _linear(lora, layer: int, proj: str, x, weight, bias):
    """The base projection plus, with ``lora``, every token's adapter delta (``LoRAStep.linear``)."""
    if lora is None:
        return quant.linear(x, weight, bias)
    return lora.linear(layer, proj, x, weight, bias)


class LlamaLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, idx: int, device, dtype, reduce=None):
        super().__init__()
        self.idx = idx
        # tensor parallelism (engine/parallel.py): o and down are row-parallel, their partial sums all-reduced
        self.reduce = reduce
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * d, cfg.num_kv_heads * d
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps, device, dtype)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps, device, dtype)
        self.qkv_weight = _param(self.q_size + 2 * self.kv_size, h, device=device, dtype=dtype)
        self.qkv_bias = _param(self.q_size + 2 * self.kv_size, device=device, dtype=dtype) if cfg.qkv_bias else None
        self.o_weight = _param(h, self.q_size, device=device, dtype=dtype)
        self.o_bias = _param(h, device=device, dtype=dtype) if cfg.o_bias else None
        self.gate_up_weight = _param(2 * cfg.intermediate_size, h, device=device, dtype=dtype)
        self.gate_up_bias = _param(2 * cfg.intermediate_size, device=device, dtype=dtype) if cfg.mlp_bias else None
        self.down_weight = _param(h, cfg.intermediate_size, device=device, dtype=dtype)
        self.down_bias = _param(h, device=device, dtype=dtype) if cfg.mlp_bias else None
        self.scale = d ** -0.5

    def forward(self, hidden, residual, cos, sin, kv_cache, attn, lora, ops: _Ops):
        """``hidden`` [T, H] is the previous layer's MLP output and ``residual`` the stream before it
        (None at the first layer, where ``hidden`` is the embedding); returns (MLP output, residual)."""
        q, residual = self.pre_attention(hidden, residual, cos, sin, kv_cache, attn, lora, ops)
        o = attn.backend.attention(q, kv_cache, attn, self.scale)
        return self.post_attention(o.view(hidden.shape[0], self.q_size), residual, lora, ops)

    def pre_attention(self, hidden, residual, cos, sin, kv_cache, attn, lora, ops: _Ops):
        """The layer up to attention: norm, q|k|v, RoPE, and k, v into the paged cache (through
        ``attn.slot_mapping`` only). Returns (q [T, Hq, D], residual)."""
        if residual is None:
            residual = hidden
            x = ops.rms_norm(hidden, self.input_layernorm.weight, self.input_layernorm.eps)
        else:
            x, residual = ops.add_rms_norm(hidden, residual, self.input_layernorm.weight, self.input_layernorm.eps)
        qkv = _linear(lora, self.idx, "qkv", x, self.qkv_weight, self.qkv_bias)  # [T, q + 2kv]
        # RoPE on q and k; k and v go into the paged cache (attention reads the new tokens' K/V from there)
        q = ops.rope_store_kv(qkv, cos, sin, kv_cache, attn, self.num_heads, self.num_kv_heads,
                              self.head_dim)
        return q, residual

    def post_attention(self, o, residual, lora, ops: _Ops):
        """The layer after attention (``o`` [T, Hq * D]): o-projection, norm, MLP. Returns (MLP output, residual)."""
        out = _linear(lora, self.idx, "o", o, self.o_weight, self.o_bias)
        if self.reduce is not None:
            self.reduce(out)
        norm = self.post_attention_layernorm
        x, residual = ops.add_rms_norm(out, residual, norm.weight, norm.eps)
        if lora is not None and lora.fuses_silu_mul:  # gate|up's delta added inside SiLU-and-multiply
            act = lora.silu_mul(self.idx, x, quant.linear(x, self.gate_up_weight, self.gate_up_bias))
        else:
            gate_up = _linear(lora, self.idx, "gate_up", x, self.gate_up_weight, self.gate_up_bias)  # [T, 2I]
            if lora is not None and lora.folds_down_shrink:  # the down shrink in the same launch (lora_fold.py)
                act = lora.silu_mul_shrink(self.idx, gate_up)
            else:
                act = ops.silu_mul(gate_up)
        down = _linear(lora, self.idx, "down", act, self.down_weight, self.down_bias)
        if self.reduce is not None:
            self.reduce(down)
        return down, residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: LlamaConfig, device, dtype, fused_ops: bool | None = None, reduce=None,
                 vocab_parts: int = 1, gather_vocab=None):
        """``cfg``: the whole model, or under tensor parallelism one rank's shard (``parallel.local_hf_config``)
        with ``reduce`` the in-place all-reduce of the row-parallel projections' partial sums. ``vocab_parts`` > 1
        (an untied LM head, tensor parallelism): this rank's LM head holds 1/vocab_parts of the vocabulary's rows and
        ``gather_vocab`` puts every rank's logits side by side."""
        super().__init__()
        self.config = cfg
        self.embed_tokens = _param(cfg.vocab_size, cfg.hidden_size, device=device, dtype=dtype)
        self.layers = nn.ModuleList(LlamaLayer(cfg, i, device, dtype, reduce) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device, dtype)
        if vocab_parts > 1 and (cfg.tie_word_embeddings or cfg.vocab_size % vocab_parts or gather_vocab is None):
            raise ValueError(f"a vocabulary-parallel LM head needs an untied head, a vocabulary ({cfg.vocab_size}) "
                             f"divisible by {vocab_parts} and a gather")
        self.gather_vocab = gather_vocab if vocab_parts > 1 else None
        self.lm_head = None if cfg.tie_word_embeddings else _param(cfg.vocab_size // vocab_parts, cfg.hidden_size,
                                                                   device=device, dtype=dtype)
        self.register_buffer("inv_freq", rope_inv_freq(cfg).to(device), persistent=False)
        self.fused_ops = fused_ops_default(device) if fused_ops is None else fused_ops
        self.ops = _Ops(self.fused_ops)

    @torch.inference_mode()
    def forward(self, input_ids, positions, kv_caches, attn, lora=None) -> torch.Tensor:
        # input_ids, positions: [T]; returns final hidden states [T, H]
        hidden, cos, sin = self.embed(input_ids, positions)
        ops, residual = self.ops, None
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden, residual = layer(hidden, residual, cos, sin, kv_cache, attn, lora, ops)
        return self.final_norm(hidden, residual)

    def embed(self, input_ids, positions):
        """(embeddings [T, H], RoPE cos [T, D], sin [T, D])."""
        hidden = F.embedding(input_ids, self.embed_tokens)
        cos, sin = rope_cos_sin(self.inv_freq, positions, hidden.dtype)
        return hidden, cos, sin

    def final_norm(self, hidden, residual) -> torch.Tensor:
        if residual is None:  # no layers
            return self.ops.rms_norm(hidden, self.norm.weight, self.norm.eps)
        return self.ops.add_rms_norm(hidden, residual, self.norm.weight, self.norm.eps)[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens if self.lm_head is None else self.lm_head
        logits = F.linear(hidden, weight)
        if self.gather_vocab is not None:  # this rank's vocabulary slice -> every rank's, side by side
            logits = self.gather_vocab(logits)
        return logits.float()  # [N, V]

    # ---- weights -------------------------------------------------------------------------------
    def weight_targets(self, name: str):
        """Map a Hugging Face tensor name to (parameter, row offset into a fused parameter or None)."""
        cfg = self.config
        if name == "model.embed_tokens.weight":
            return self.embed_tokens, None
        if name == "model.norm.weight":
            return self.norm.weight, None
        if name == "lm_head.weight":
            return (self.lm_head, None) if self.lm_head is not None else (None, None)
        parts = name.split(".")
        if parts[:2] != ["model", "layers"]:
            return None, None
        layer = self.layers[int(parts[2])]
        sub = ".".join(parts[3:])
        q, kv, inter = layer.q_size, layer.kv_size, cfg.intermediate_size
        table = {
            "input_layernorm.weight": (layer.input_layernorm.weight, None),
            "post_attention_layernorm.weight": (layer.post_attention_layernorm.weight, None),
            "self_attn.q_proj.weight": (layer.qkv_weight, 0), "self_attn.k_proj.weight": (layer.qkv_weight, q),
            "self_attn.v_proj.weight": (layer.qkv_weight, q + kv),
            "self_attn.q_proj.bias": (layer.qkv_bias, 0), "self_attn.k_proj.bias": (layer.qkv_bias, q),
            "self_attn.v_proj.bias": (layer.qkv_bias, q + kv),
            "self_attn.o_proj.weight": (layer.o_weight, None), "self_attn.o_proj.bias": (layer.o_bias, None),
            "mlp.gate_proj.weight": (layer.gate_up_weight, 0), "mlp.up_proj.weight": (layer.gate_up_weight, inter),
            "mlp.gate_proj.bias": (layer.gate_up_bias, 0), "mlp.up_proj.bias": (layer.gate_up_bias, inter),
            "mlp.down_proj.weight": (layer.down_weight, None), "mlp.down_proj.bias": (layer.down_bias, None),
        }
        return table.get(sub, (None, None))
