"""Generate a small Llama-architecture model, a locally trained tokenizer and PEFT adapters.

Everything is built from seeded random weights and text shipped with the package: no network.
The output loads unchanged with ``AutoModelForCausalLM``, ``AutoTokenizer`` and ``PeftModel``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] in ['system', 'user', 'assistant'] %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{% else %}"
    "{{ '<|user|>' + message['role'] + ': ' + message['content'] + '<|end|>' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
DEFAULT_RANKS = (8, 16, 4, 32, 12, 64)


@dataclass
class DemoModelSpec:
    arch: str = "llama"  # llama | qwen2 | mistral
    layers: int = 2
    hidden_size: int = 64
    heads: int = 4
    kv_heads: int = 2
    intermediate_size: int | None = None  # default: ~2.7 x hidden, multiple of 8
    vocab_size: int = 512
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rope_scaling: str | None = None  # None | "llama3"
    tie_word_embeddings: bool = False
    seed: int = 0
    adapters: int = 4
    adapter_ranks: tuple[int, ...] = DEFAULT_RANKS
    adapter_targets: tuple[tuple[str, ...], ...] = field(default_factory=lambda: (ALL_TARGETS,))

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.heads

    @property
    def ffn_size(self) -> int:
        if self.intermediate_size:
            return self.intermediate_size
        return int(math.ceil(self.hidden_size * 8 / 3 / 8) * 8)


def train_tokenizer(out_dir: Path, vocab_size: int) -> int:
    """Train a byte-level BPE on the shipped corpus and save it as a HF tokenizer. Returns its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    text = resources.files("loraplex").joinpath("data/corpus.txt").read_text(encoding="utf-8")
    lines = [ln for ln in text.splitlines() if ln.strip()]
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines * 4, trainer=trainer)
    bos_id = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="<|end|>",
        unk_token="<unk>",
        pad_token="<pad>",
        additional_special_tokens=SPECIAL_TOKENS[4:],
        model_max_length=1 << 20,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return tok.get_vocab_size()


def _model_config(spec: DemoModelSpec, tok_ids: dict[str, int]):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    common = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.ffn_size,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rope_theta=spec.rope_theta,
        rms_norm_eps=1e-5,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=tok_ids["<s>"],
        eos_token_id=tok_ids["<|end|>"],
        pad_token_id=tok_ids["<pad>"],
        dtype="float32",
    )
    if spec.arch == "llama":
        if spec.rope_scaling == "llama3":
            common["rope_scaling"] = {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256,
            }
        return LlamaConfig(head_dim=spec.head_dim, attention_bias=False, mlp_bias=False, **common)
    if spec.arch == "mistral":
        return MistralConfig(head_dim=spec.head_dim, sliding_window=None, **common)
    if spec.arch == "qwen2":
        return Qwen2Config(use_sliding_window=False, **common)
    raise ValueError(f"arch must be one of llama, mistral, qwen2 (got {spec.arch!r})")


def _randomize(model, seed: int) -> None:
    """Scale weights so logits are well separated (no near-ties between implementations)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
            elif name.endswith(".bias"):
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
            elif "embed_tokens" in name:
                param.copy_(torch.randn(param.shape, generator=gen))
            else:
                fan_in = param.shape[-1]
                param.copy_(torch.randn(param.shape, generator=gen) * (1.5 / math.sqrt(fan_in)))


def write_adapter(
    out_dir: Path,
    *,
    config,
    rank: int,
    targets: tuple[str, ...],
    seed: int,
    alpha: float | None = None,
    use_rslora: bool = False,
    base_model_name_or_path: str = "",
    scale: float = 1.0,
) -> Path:
    """Write one PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors)."""
    import torch
    from safetensors.torch import save_file

    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    q_out = config.num_attention_heads * head_dim
    kv_out = config.num_key_value_heads * head_dim
    shapes = {
        "q_proj": ("self_attn", config.hidden_size, q_out),
        "k_proj": ("self_attn", config.hidden_size, kv_out),
        "v_proj": ("self_attn", config.hidden_size, kv_out),
        "o_proj": ("self_attn", q_out, config.hidden_size),
        "gate_proj": ("mlp", config.hidden_size, config.intermediate_size),
        "up_proj": ("mlp", config.hidden_size, config.intermediate_size),
        "down_proj": ("mlp", config.intermediate_size, config.hidden_size),
    }
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for target in targets:
            group, in_f, out_f = shapes[target]
            prefix = f"base_model.model.model.layers.{layer}.{group}.{target}"
            a = torch.randn(rank, in_f, generator=gen) / math.sqrt(in_f)
            b = torch.randn(out_f, rank, generator=gen) * (scale / math.sqrt(rank))
            tensors[f"{prefix}.lora_A.weight"] = a.contiguous()
            tensors[f"{prefix}.lora_B.weight"] = b.contiguous()
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": rank,
        "lora_alpha": alpha if alpha is not None else 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": sorted(targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": use_rslora,
        "use_dora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
    }
    (out_dir / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2) + "\n")
    return out_dir


def _forget_earlier_build(out: Path) -> None:
    """Rewriting a demo model: drop the earlier manifest first (a rewrite cut short is then no demo model the
    server would take as complete) and the adapters it lists (with fewer adapters or another shape they
    would stay behind, not fitting the new base model). Nothing the manifest does not name is removed."""
    import shutil

    manifest = out / "loraplex_demo.json"
    if not manifest.is_file():
        return
    try:
        names = [a["name"] for a in json.loads(manifest.read_text())["adapters"]]
    except (ValueError, KeyError, TypeError):
        names = []
    manifest.unlink()
    for name in names:
        path = out / "adapters" / name
        if isinstance(name, str) and path.parent == out / "adapters" and path.is_dir():
            shutil.rmtree(path)


def build_demo_model(out_dir: str | Path, spec: DemoModelSpec | None = None) -> dict:
    """Write model, tokenizer and ``spec.adapters`` adapters under ``out_dir``.

    Layout: ``out_dir/`` holds the HF model + tokenizer; ``out_dir/adapters/<name>/`` each adapter.
    Returns a manifest (also written to ``out_dir/loraplex_demo.json``).
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    spec = spec or DemoModelSpec()
    if spec.hidden_size % spec.heads or spec.heads % spec.kv_heads:
        raise ValueError("hidden_size must divide by heads, and heads by kv_heads")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _forget_earlier_build(out)
    tok_size = train_tokenizer(out, spec.vocab_size)
    if tok_size > spec.vocab_size:
        raise ValueError(f"tokenizer has {tok_size} tokens, more than --vocab-size {spec.vocab_size}")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    config = _model_config(spec, ids)
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, spec.seed)
    model.save_pretrained(str(out), safe_serialization=True)
    GenerationConfig(
        bos_token_id=ids["<s>"], eos_token_id=[ids["<|end|>"], ids["</s>"]], pad_token_id=ids["<pad>"],
        do_sample=False,
    ).save_pretrained(str(out))

    adapters = []
    for i in range(spec.adapters):
        rank = spec.adapter_ranks[i % len(spec.adapter_ranks)]
        targets = spec.adapter_targets[i % len(spec.adapter_targets)]
        name = f"adapter-{i}"
        write_adapter(
            out / "adapters" / name, config=config, rank=rank, targets=targets, seed=spec.seed * 1000 + i + 1,
            base_model_name_or_path=str(out),
        )
        adapters.append({"name": name, "rank": rank, "target_modules": list(targets)})
    manifest = {"model_dir": str(out), "arch": spec.arch, "adapters": adapters, "vocab_size": spec.vocab_size}
    (out / "loraplex_demo.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest
