"""The LoRA-able projections of a Llama-family layer and their shapes under a base config.

Glossary: ``module`` is a PEFT target name (``q_proj``...); ``proj`` is a fused projection of the engine's
model (``qkv``, ``o``, ``gate_up``, ``down``) made of one or more slices, one per module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MODULE_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
                 "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
PROJ_MODULES = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
                "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}
MODULE_INDEX = {m: i for i, m in enumerate(MODULES)}


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    if isinstance(cfg, dict):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


@dataclass(frozen=True)
class BaseShapes:
    num_layers: int
    hidden_size: int
    q_size: int  # num_attention_heads * head_dim
    kv_size: int  # num_key_value_heads * head_dim
    intermediate_size: int

    @classmethod
    def from_config(cls, cfg: Any) -> BaseShapes:
        """From a ``transformers`` config, its dict, or a BaseShapes."""
        if isinstance(cfg, BaseShapes):
            return cfg
        hidden = int(_get(cfg, "hidden_size"))
        heads = int(_get(cfg, "num_attention_heads"))
        kv_heads = int(_get(cfg, "num_key_value_heads") or heads)
        head_dim = int(_get(cfg, "head_dim") or hidden // heads)
        return cls(num_layers=int(_get(cfg, "num_hidden_layers")), hidden_size=hidden, q_size=heads * head_dim,
                   kv_size=kv_heads * head_dim, intermediate_size=int(_get(cfg, "intermediate_size")))

    def in_out(self, module: str) -> tuple[int, int]:
        h, q, kv, i = self.hidden_size, self.q_size, self.kv_size, self.intermediate_size
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}[module]

    def proj_in(self, proj: str) -> int:
        return self.in_out(PROJ_MODULES[proj][0])[0]

    def slice_widths(self, proj: str) -> tuple[int, ...]:
        return tuple(self.in_out(m)[1] for m in PROJ_MODULES[proj])
