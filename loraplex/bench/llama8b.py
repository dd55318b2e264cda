"""A Llama-3-8B-shaped model with random bf16 weights and random PEFT adapters, written for the engine.

No download: the config is Llama-3-8B's (32 layers, hidden 4096, 32/8 heads, FFN 14336, vocab 128256,
llama3 rope), weights are drawn on the GPU (std 0.02, norms 1) and written as one safetensors shard per
layer with an index, beside a small tokenizer trained locally (ids it does not know decode to nothing,
which is fine for a throughput run with ``ignore_eos``). Adapters are PEFT directories of a chosen rank
on all seven projections. A directory already complete for the same spec is reused.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from loraplex.bench.roofline import PROJECTIONS, ModelShape

log = logging.getLogger(__name__)

LLAMA3_8B = dict(
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=8192,
)
ROPE_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192, "rope_theta": 500000.0}


@dataclass(frozen=True)
class RandomModelSpec:
    num_layers: int = 32
    hidden_size: int = LLAMA3_8B["hidden_size"]
    intermediate_size: int = LLAMA3_8B["intermediate_size"]
    num_heads: int = LLAMA3_8B["num_attention_heads"]
    num_kv_heads: int = LLAMA3_8B["num_key_value_heads"]
    vocab_size: int = LLAMA3_8B["vocab_size"]
    max_position_embeddings: int = LLAMA3_8B["max_position_embeddings"]
    seed: int = 0


def hf_config(spec: RandomModelSpec) -> dict:
    head_dim = spec.hidden_size // spec.num_heads
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": spec.hidden_size, "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers, "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads, "head_dim": head_dim, "vocab_size": spec.vocab_size,
        "max_position_embeddings": spec.max_position_embeddings, "rms_norm_eps": 1e-5,
        "rope_theta": ROPE_LLAMA3["rope_theta"],
        "rope_scaling": {k: v for k, v in ROPE_LLAMA3.items() if k != "rope_theta"},
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 7, "pad_token_id": 3, "dtype": "bfloat16",
    }


def _layer_tensors(cfg: dict, layer: int, gen: torch.Generator, device) -> dict[str, torch.Tensor]:
    shape = ModelShape.from_hf(cfg)
    out = {}
    for proj, (in_f, out_f) in shape.proj_dims().items():
        group = "mlp" if proj in ("gate_proj", "up_proj", "down_proj") else "self_attn"
        w = torch.empty(out_f, in_f, device=device, dtype=torch.bfloat16).normal_(0.0, 0.02, generator=gen)
        out[f"model.layers.{layer}.{group}.{proj}.weight"] = w
    for norm in ("input_layernorm", "post_attention_layernorm"):
        out[f"model.layers.{layer}.{norm}.weight"] = torch.ones(cfg["hidden_size"], device=device,
                                                                dtype=torch.bfloat16)
    return out


def write_random_model(out_dir: str | Path, spec: RandomModelSpec, device: torch.device) -> Path:
    """Write config, tokenizer and random bf16 safetensors shards (about 16 GB for the full shape)."""
    from safetensors.torch import save_file

    from loraplex.demo import train_tokenizer

    out = Path(out_dir)
    marker = out / "loraplex_random_model.json"
    if marker.exists() and json.loads(marker.read_text()) == asdict(spec):
        return out
    out.mkdir(parents=True, exist_ok=True)
    cfg = hf_config(spec)
    train_tokenizer(out, 512)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    gen = torch.Generator(device=device).manual_seed(spec.seed)
    weight_map: dict[str, str] = {}

    def save(name: str, tensors: dict[str, torch.Tensor]) -> None:
        save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))

    h, vocab = spec.hidden_size, spec.vocab_size
    save("model-embed.safetensors", {
        "model.embed_tokens.weight": torch.empty(vocab, h, device=device, dtype=torch.bfloat16).normal_(generator=gen),
        "lm_head.weight": torch.empty(vocab, h, device=device, dtype=torch.bfloat16).normal_(0, 0.02, generator=gen),
        "model.norm.weight": torch.ones(h, device=device, dtype=torch.bfloat16),
    })
    for layer in range(spec.num_layers):
        save(f"model-layer-{layer:03d}.safetensors", _layer_tensors(cfg, layer, gen, device))
    index = {"metadata": {}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")
    marker.write_text(json.dumps(asdict(spec)) + "\n")
    log.info("wrote a random %d-layer model to %s", spec.num_layers, out)
    return out


def write_random_adapter(
    out_dir: str | Path, cfg: dict, rank: int, seed: int, device: torch.device,
    targets: tuple[str, ...] = PROJECTIONS,
) -> Path:
    """One PEFT LoRA adapter (bf16) of ``rank`` on ``targets`` of every layer; B is non-zero."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    if (out / "adapter_model.safetensors").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    shape = ModelShape.from_hf(cfg)
    dims = shape.proj_dims()
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for layer in range(shape.num_layers):
        for proj in targets:
            in_f, out_f = dims[proj]
            group = "mlp" if proj in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{group}.{proj}"
            a = torch.empty(rank, in_f, device=device).normal_(0, 1 / math.sqrt(in_f), generator=gen)
            b = torch.empty(out_f, rank, device=device).normal_(0, 0.01, generator=gen)
            tensors[f"{prefix}.lora_A.weight"] = a.to(torch.bfloat16).cpu()
            tensors[f"{prefix}.lora_B.weight"] = b.to(torch.bfloat16).cpu()
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": "", "r": rank,
        "lora_alpha": 2 * rank, "lora_dropout": 0.0, "target_modules": sorted(targets), "bias": "none",
        "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "modules_to_save": None,
        "init_lora_weights": True, "inference_mode": True,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def write_adapter_pool(model_dir: str | Path, count: int, rank: int, device: torch.device) -> list[Path]:
    """``count`` adapter directories under ``model_dir/bench-adapters-r{rank}/``."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    root = Path(model_dir) / f"bench-adapters-r{rank}"
    return [write_random_adapter(root / f"adapter-{i:04d}", cfg, rank, seed=1000 + i, device=device)
            for i in range(count)]
