"""Load Hugging Face safetensors checkpoints (never pickle) into a model, fusing q|k|v and gate|up."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

log = logging.getLogger(__name__)


def safetensors_files(model_dir: str | Path) -> list[Path]:
    root = Path(model_dir)
    index = root / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [root / n for n in names]
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {root} (pickle checkpoints are not loaded)")
    return files


def iter_tensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                yield name, f.get_tensor(name)


def load_weights(model, model_dir: str | Path, shard=None) -> None:
    """Copy every checkpoint tensor into the model's (possibly fused) parameters; fail on gaps. ``shard``:
    ``(name, tensor) -> tensor``, the part this process keeps (tensor parallelism: ``parallel.shard_checkpoint_tensor``)."""
    expected = {id(p): name for name, p in model.named_parameters()}
    filled: dict[int, int] = {}  # parameter -> rows written
    for name, tensor in iter_tensors(model_dir):
        param, offset = model.weight_targets(name)
        if param is None:
            if "rotary_emb" not in name and name != "lm_head.weight":
                log.debug("ignoring checkpoint tensor %s", name)
            continue
        if shard is not None:
            tensor = shard(name, tensor)
        with torch.no_grad():
            if offset is None:
                if param.shape != tensor.shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(param.shape)}")
                param.copy_(tensor)
            else:
                rows = tensor.shape[0]
                if offset + rows > param.shape[0] or param.shape[1:] != tensor.shape[1:]:
                    raise ValueError(f"{name}: shape {tuple(tensor.shape)} does not fit the fused parameter")
                param[offset:offset + rows].copy_(tensor)
        filled[id(param)] = filled.get(id(param), 0) + tensor.shape[0]
    missing = [n for pid, n in expected.items() if filled.get(pid, 0) < model.get_parameter(n).shape[0]]
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks weights for: {', '.join(missing[:8])}")
