"""Parse and check ``adapter_config.json``: only plain LoRA that the engine computes exactly is accepted."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from loraplex.adapters.errors import AdapterError
from loraplex.adapters.modules import MODULES

CONFIG_NAME = "adapter_config.json"
# options that change the math (or run code); each must be absent or at its neutral value
# lora_alpha / r (sqrt(r) with rsLoRA): trained adapters use about 0.5 to 4; far above, the delta overflows the
# activations and the adapter's outputs are NaN
MAX_SCALING = 1000.0
_MUST_BE_EMPTY = ("modules_to_save", "rank_pattern", "alpha_pattern", "layer_replication", "megatron_config",
                  "trainable_token_indices", "target_parameters", "alora_invocation_tokens", "arrow_config")
_MUST_BE_FALSE = ("use_dora", "fan_in_fan_out", "lora_bias", "use_qalora")


@dataclass(frozen=True)
class LoraConfig:
    rank: int
    lora_alpha: float
    use_rslora: bool
    target_modules: frozenset[str] | None  # None: all supported modules may carry weights
    base_model_name_or_path: str
    # PEFT adapts only these layers and never the excluded modules; weights elsewhere would be dropped by PEFT
    layers: frozenset[int] | None = None  # None: every layer
    exclude_modules: frozenset[str] = frozenset()


def _fail(message: str, field: str, limit: object = None) -> AdapterError:
    return AdapterError(f"{field}: {message}", file=CONFIG_NAME, field=field, limit=limit)


def _find_key(obj: object, key: str, depth: int = 0) -> bool:
    if depth > 16:
        return False
    if isinstance(obj, dict):
        return key in obj or any(_find_key(v, key, depth + 1) for v in obj.values())
    if isinstance(obj, list):
        return any(_find_key(v, key, depth + 1) for v in obj)
    return False


def parse_adapter_config(path: Path, *, max_rank: int, max_bytes: int) -> LoraConfig:
    if not path.is_file():
        raise AdapterError(f"missing {CONFIG_NAME}", file=CONFIG_NAME)
    size = path.stat().st_size
    if size > max_bytes:
        raise AdapterError(f"config is {size} bytes, over the cap", file=CONFIG_NAME, limit=max_bytes)
    try:
        cfg = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise AdapterError(f"config is not valid JSON ({exc.__class__.__name__})", file=CONFIG_NAME) from None
    if not isinstance(cfg, dict):
        raise AdapterError("config must be a JSON object", file=CONFIG_NAME)
    if _find_key(cfg, "auto_map"):
        raise _fail("code references are refused", "auto_map")
    # module names PEFT may import (AutoPeftModel: auto_mapping.parent_library; megatron_config: megatron_core)
    if cfg.get("auto_mapping"):
        raise _fail("code references are refused (must be null)", "auto_mapping")
    if cfg.get("megatron_core") not in (None, "megatron.core"):
        raise _fail("code references are refused (must be null or the default)", "megatron_core")
    peft_type = cfg.get("peft_type")
    if peft_type != "LORA":
        raise _fail(f"only LORA adapters are supported, got {peft_type!r}", "peft_type")
    rank = cfg.get("r", 8)
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise _fail(f"must be a positive integer, got {rank!r}", "r")
    if rank > max_rank:
        raise _fail(f"rank {rank} is over the engine's max_lora_rank", "r", limit=max_rank)
    alpha = cfg.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha) or alpha <= 0:
        raise _fail(f"must be a positive number, got {alpha!r}", "lora_alpha")
    use_rslora = cfg.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise _fail(f"must be true or false, got {use_rslora!r}", "use_rslora")
    scaling = alpha / (math.sqrt(rank) if use_rslora else rank)
    if scaling > MAX_SCALING:
        raise _fail(f"scaling lora_alpha / {'sqrt(r)' if use_rslora else 'r'} = {scaling:.4g} is over the cap",
                    "lora_alpha", limit=MAX_SCALING)
    bias = cfg.get("bias", "none")
    if bias != "none":
        raise _fail(f"only 'none' is supported, got {bias!r}", "bias")
    for key in _MUST_BE_FALSE:
        if cfg.get(key):
            raise _fail("is not supported (must be false)", key)
    for key in _MUST_BE_EMPTY:
        if cfg.get(key):
            raise _fail("is not supported (must be empty)", key)
    base = cfg.get("base_model_name_or_path") or ""
    return LoraConfig(rank=rank, lora_alpha=float(alpha), use_rslora=use_rslora,
                      target_modules=_targets(cfg.get("target_modules")), base_model_name_or_path=str(base)[:512],
                      layers=_layers(cfg.get("layers_to_transform")), exclude_modules=_excluded(cfg.get("exclude_modules")))


def _layers(value: object) -> frozenset[int] | None:
    if value is None:
        return None
    layers = [value] if isinstance(value, int) else value
    if (isinstance(value, bool) or not isinstance(layers, list)
            or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in layers)):
        raise _fail("must be a non-negative integer or a list of them", "layers_to_transform")
    return frozenset(layers)


def _excluded(value: object) -> frozenset[str]:
    if not value:
        return frozenset()
    if not isinstance(value, list) or not all(isinstance(n, str) for n in value):
        raise _fail("must be a list of module names (regular expressions are not accepted)", "exclude_modules")
    return frozenset(n.rsplit(".", 1)[-1] for n in value)


def _targets(value: object) -> frozenset[str] | None:
    if value is None or value == "all-linear":
        return None
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise _fail("must be a list of module names", "target_modules")
    out = set()
    for name in names:
        short = name.rsplit(".", 1)[-1]
        if short not in MODULES:
            raise _fail(f"unknown target module {name!r} (supported: {', '.join(MODULES)}; regular "
                        "expressions are not accepted)", "target_modules")
        out.add(short)
    return frozenset(out)
