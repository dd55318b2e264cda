"""Validate a PEFT LoRA directory against the base model before anything reaches the GPU.

Used by the engine (before an adapter is cached) and by the registry's upload endpoint: no engine import.
Only ``adapter_config.json`` and ``adapter_model.safetensors`` are read; a directory holding a pickle
weight file is refused without that file being opened.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraplex.adapters.config_check import CONFIG_NAME, LoraConfig, parse_adapter_config
from loraplex.adapters.errors import AdapterError
from loraplex.adapters.modules import MODULE_PARENT, MODULES, BaseShapes
from loraplex.adapters.safetensors_check import DEFAULT_MAX_HEADER_BYTES, TensorEntry, read_safetensors_header

WEIGHTS_NAME = "adapter_model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".joblib", ".npy", ".npz")
ALLOWED_DTYPES = ("F32", "F16", "BF16")
DEFAULT_MAX_CONFIG_BYTES = 64 << 10
_NAME = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.([a-z_]+)\.lora_(A|B)\.weight$")


@dataclass(frozen=True)
class AdapterSpec:
    path: str
    rank: int
    lora_alpha: float
    use_rslora: bool
    scaling: float  # lora_alpha / rank, or lora_alpha / sqrt(rank) with use_rslora
    target_modules: tuple[str, ...]  # modules that carry tensors, in MODULES order
    module_layers: dict[str, tuple[int, ...]]  # module -> layers that carry its tensors
    dtype: str  # safetensors dtype of the weights (F32 | F16 | BF16)
    num_params: int
    num_bytes: int  # size of the weights file
    base_model_name_or_path: str


def max_tensors_for(shapes: BaseShapes) -> int:
    # two per module per layer, plus slack so a stray tensor gets its own precise error
    return 2 * len(MODULES) * shapes.num_layers + 64


def validate_adapter_dir(
    path: str | Path,
    base_config: Any,
    max_rank: int,
    *,
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
    max_config_bytes: int = DEFAULT_MAX_CONFIG_BYTES,
    max_file_bytes: int | None = None,
) -> AdapterSpec:
    """Check everything about a PEFT LoRA directory, values included; raise AdapterError on the first problem.

    ``base_config`` is the base model's transformers config (or its dict, or BaseShapes).
    """
    spec, _ = read_adapter(path, base_config, max_rank, keep_tensors=False, max_header_bytes=max_header_bytes,
                           max_config_bytes=max_config_bytes, max_file_bytes=max_file_bytes)
    return spec


def read_adapter(path, base_config, max_rank, *, keep_tensors: bool,
                 max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
                 max_config_bytes: int = DEFAULT_MAX_CONFIG_BYTES,
                 max_file_bytes: int | None = None):
    """Validate, and return (AdapterSpec, {(layer, module): (A [r, in], B [out, r])} or None)."""
    root = Path(path)
    if not root.is_dir():
        raise AdapterError("adapter path is not a directory", file=str(root))
    _refuse_pickles(root)
    shapes = BaseShapes.from_config(base_config)
    cfg = parse_adapter_config(root / CONFIG_NAME, max_rank=max_rank, max_bytes=max_config_bytes)
    weights = root / WEIGHTS_NAME
    if not weights.is_file():
        raise AdapterError(f"missing {WEIGHTS_NAME} (the only weight format accepted)", file=WEIGHTS_NAME)
    entries = read_safetensors_header(weights, max_header_bytes=max_header_bytes,
                                      max_tensors=max_tensors_for(shapes),
                                      max_file_bytes=max_file_bytes)
    pairs = _check_entries(entries, cfg, shapes)
    tensors = _read_tensors(weights, pairs, keep_tensors)
    module_layers = {m: tuple(sorted(layer for layer, mod in pairs if mod == m)) for m in MODULES}
    module_layers = {m: layers for m, layers in module_layers.items() if layers}
    scaling = cfg.lora_alpha / (math.sqrt(cfg.rank) if cfg.use_rslora else cfg.rank)
    spec = AdapterSpec(
        path=str(root), rank=cfg.rank, lora_alpha=cfg.lora_alpha, use_rslora=cfg.use_rslora, scaling=scaling,
        target_modules=tuple(module_layers), module_layers=module_layers,
        dtype=next(iter(entries.values())).dtype,
        num_params=sum(math.prod(e.shape) for e in entries.values()), num_bytes=weights.stat().st_size,
        base_model_name_or_path=cfg.base_model_name_or_path,
    )
    return spec, tensors


def _refuse_pickles(root: Path) -> None:
    for entry in sorted(root.iterdir()):  # names only: nothing here is opened
        if entry.name.lower().endswith(PICKLE_SUFFIXES):
            raise AdapterError("pickle-format weight files are refused and never opened; save the adapter with "
                               f"safetensors ({WEIGHTS_NAME})", file=entry.name)


def _check_entries(entries: dict[str, TensorEntry], cfg: LoraConfig,
                   shapes: BaseShapes) -> dict[tuple[int, str], tuple[str, str]]:
    """Names, dtypes and shapes; returns {(layer, module): (A name, B name)}."""
    if not entries:
        raise AdapterError("adapter has no tensors", file=WEIGHTS_NAME)
    if cfg.layers is not None and max(cfg.layers, default=-1) >= shapes.num_layers:
        raise AdapterError(f"layers_to_transform: layer {max(cfg.layers)} does not exist in the base model",
                           file=CONFIG_NAME, field="layers_to_transform", limit=f"{shapes.num_layers} layers")
    found: dict[tuple[int, str], dict[str, str]] = {}
    for name, entry in entries.items():
        match = _NAME.match(name)
        if not match:
            raise AdapterError("unexpected tensor: only base_model.model.model.layers.<i>.<self_attn|mlp>."
                               "<module>.lora_<A|B>.weight is accepted (no biases, embeddings, DoRA or "
                               "modules_to_save)", file=WEIGHTS_NAME, tensor=name)
        layer, parent, module, which = int(match[1]), match[2], match[3], match[4]
        if module not in MODULES or MODULE_PARENT[module] != parent:
            raise AdapterError(f"unknown target module {parent}.{module} (supported: {', '.join(MODULES)})",
                               file=WEIGHTS_NAME, tensor=name)
        if cfg.target_modules is not None and module not in cfg.target_modules:
            raise AdapterError(f"module {module} carries weights but is not in target_modules",
                               file=WEIGHTS_NAME, tensor=name)
        if module in cfg.exclude_modules:
            raise AdapterError(f"module {module} carries weights but is listed in exclude_modules",
                               file=WEIGHTS_NAME, tensor=name)
        if cfg.layers is not None and layer not in cfg.layers:
            raise AdapterError(f"layer {layer} carries weights but is not in layers_to_transform",
                               file=WEIGHTS_NAME, tensor=name)
        if layer >= shapes.num_layers:
            raise AdapterError(f"layer {layer} does not exist in the base model", file=WEIGHTS_NAME, tensor=name,
                               limit=f"{shapes.num_layers} layers")
        if entry.dtype not in ALLOWED_DTYPES:
            raise AdapterError(f"dtype {entry.dtype} is not allowed (allowed: {', '.join(ALLOWED_DTYPES)})",
                               file=WEIGHTS_NAME, tensor=name)
        in_f, out_f = shapes.in_out(module)
        want = (cfg.rank, in_f) if which == "A" else (out_f, cfg.rank)
        if entry.shape != want:
            raise AdapterError(f"shape {list(entry.shape)} does not match the base model: expected {list(want)} "
                               f"(r={cfg.rank})", file=WEIGHTS_NAME, tensor=name)
        found.setdefault((layer, module), {})[which] = name
    for (layer, module), names in found.items():
        if set(names) != {"A", "B"}:
            missing = "lora_B" if "A" in names else "lora_A"
            raise AdapterError(f"layer {layer} {module} has no {missing} weight", file=WEIGHTS_NAME,
                               tensor=next(iter(names.values())))
    return {key: (names["A"], names["B"]) for key, names in sorted(found.items())}


def all_finite(tensor) -> bool:
    """No NaN or Inf: no exponent field of all ones, read from the bits (the masked exponents' maximum is the
    mask exactly when one is all ones). Exact, and on the CPU several times faster than ``torch.isfinite`` for
    bfloat16 (best of 3, a rank-16 Llama-3-8B adapter on a busy 2-core machine, torch 2.13: 0.10 s against
    0.68 s), which every adapter read and upload pays."""
    import torch

    spec = {torch.bfloat16: (torch.int16, 0x7F80), torch.float16: (torch.int16, 0x7C00),
            torch.float32: (torch.int32, 0x7F800000)}.get(tensor.dtype)
    if spec is None:
        return bool(torch.isfinite(tensor).all())
    int_dtype, exponent = spec
    bits = tensor.contiguous().view(int_dtype)
    return bits.numel() == 0 or int((bits & exponent).max()) != exponent


def _read_tensors(weights: Path, pairs: dict, keep: bool):
    from safetensors import safe_open

    kept = {} if keep else None
    try:
        with safe_open(str(weights), framework="pt") as f:
            for key, names in pairs.items():
                loaded = []
                for name in names:
                    tensor = f.get_tensor(name)
                    if not all_finite(tensor):
                        raise AdapterError("tensor holds NaN or Inf values", file=WEIGHTS_NAME, tensor=name)
                    loaded.append(tensor)
                if kept is not None:
                    kept[key] = (loaded[0], loaded[1])
    except AdapterError:
        raise
    except Exception as exc:  # the library's own checks (truncated data...) are still user errors
        raise AdapterError(f"unreadable safetensors data: {exc}", file=WEIGHTS_NAME) from None
    return kept

