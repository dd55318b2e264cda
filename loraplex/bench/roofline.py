"""The HBM roofline of a decode step: bytes it must read ÷ the device copy bandwidth measured in this run
(and, for whole runs, the compute floor of prefill-heavy steps: ``workload_floor``).

A decode step reads every base weight once (the embedding only for the batch's rows), the weights of each
adapter that is active in the step (A and B of all targeted projections, at the adapter's real rank),
and the whole KV of every sequence in the batch. Activations and the new tokens' KV writes are
kilobytes and are left out, so the floor is a lower bound on the step time.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from loraplex.bench.timing import time_per_call

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool = False

    @classmethod
    def from_hf(cls, cfg: dict) -> ModelShape:
        heads = cfg["num_attention_heads"]
        return cls(
            hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"], num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads, vocab_size=cfg["vocab_size"],
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )

    def proj_dims(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of each LoRA-targetable projection."""
        h, i = self.hidden_size, self.intermediate_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def layer_params(self) -> int:
        return sum(a * b for a, b in self.proj_dims().values()) + 2 * self.hidden_size

    def linear_params(self) -> int:
        """Weights of every layer's projections (what each token multiplies), LM head excluded."""
        return self.num_layers * sum(a * b for a, b in self.proj_dims().values())

    def lora_params_per_rank(self, targets: tuple[str, ...] = PROJECTIONS) -> int:
        """A and B elements of one adapter of rank 1 over all layers (81,920 per layer for Llama-3-8B)."""
        dims = self.proj_dims()
        return self.num_layers * sum(dims[t][0] + dims[t][1] for t in targets)

    def kv_bytes_per_token(self, elem_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem_bytes


@dataclass
class StepBytes:
    weights: int
    lora: int
    kv: int

    @property
    def total(self) -> int:
        return self.weights + self.lora + self.kv


def step_bytes(
    shape: ModelShape, num_tokens: int, context_tokens: int, adapter_ranks: list[int], elem_bytes: int = 2,
    targets: tuple[str, ...] = PROJECTIONS, kv_elem_bytes: float | None = None, weight_quant: str | None = None,
) -> StepBytes:
    """Bytes any engine step reads: ``num_tokens`` embedding rows, the KV of ``context_tokens`` tokens summed over
    the batch (each sequence's context including this step's tokens), ``adapter_ranks`` per *distinct* adapter.
    ``kv_elem_bytes``: bytes per cached K/V value (1 for an fp8 cache, 1 + 4 / head_dim for int8 with its row
    scales; default ``elem_bytes``). ``weight_quant="int8"`` or ``"fp8"``: the projections as one byte per weight with
    an fp32 scale per output row (``EngineConfig.quantization``); embeddings, norms and the LM head stay at
    ``elem_bytes``."""
    lm_head = shape.vocab_size * shape.hidden_size
    embed_rows = num_tokens * shape.hidden_size
    weights = (shape.num_layers * shape.layer_params() + lm_head + embed_rows + shape.hidden_size) * elem_bytes
    if weight_quant in ("int8", "fp8"):
        dims = shape.proj_dims().values()
        proj = shape.num_layers * sum(a * b for a, b in dims)
        rows = shape.num_layers * sum(b for _, b in dims)
        weights += proj * (1 - elem_bytes) + 4 * rows
    elif weight_quant is not None:
        raise ValueError(f"weight_quant: int8, fp8 or None, got {weight_quant!r}")
    lora = sum(adapter_ranks) * shape.lora_params_per_rank(targets) * elem_bytes
    kv = context_tokens * shape.kv_bytes_per_token(elem_bytes if kv_elem_bytes is None else kv_elem_bytes)
    return StepBytes(weights=weights, lora=lora, kv=kv)


def decode_step_bytes(
    shape: ModelShape, context_lens: list[int], adapter_ranks: list[int], elem_bytes: int = 2,
    targets: tuple[str, ...] = PROJECTIONS, kv_elem_bytes: float | None = None, weight_quant: str | None = None,
) -> StepBytes:
    """Bytes one decode step reads: ``context_lens`` per sequence, ``adapter_ranks`` per *distinct* active adapter."""
    return step_bytes(shape, len(context_lens), sum(context_lens), adapter_ranks, elem_bytes, targets, kv_elem_bytes,
                      weight_quant)


def step_flops(shape: ModelShape, num_tokens: int, num_sampled: int) -> int:
    """Multiply-adds ×2 that a step cannot avoid: every token through every projection, the sampled rows through
    the LM head. Attention and LoRA FLOPs are left out (small at these lengths), so this is a lower bound too."""
    return 2 * (shape.linear_params() * num_tokens + shape.vocab_size * shape.hidden_size * num_sampled)


def measure_matmul_flops(device: torch.device, n: int | None = None, iters: int = 10) -> float:
    """Dense matrix-product rate in FLOP/s on random data (bf16 n×n×n on a GPU, float32 on the CPU)."""
    cuda = device.type == "cuda"
    n = n or (8192 if cuda else 256)
    dtype = torch.bfloat16 if cuda else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    seconds = time_per_call(lambda: a @ b, device, iters=iters)
    return 2 * n**3 / seconds


def measure_copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, iters: int = 20, repeats: int = 3) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written: the best of
    ``repeats`` timed loops after a warm-up of ``2 * iters`` copies. A GPU that was idle runs at low clocks
    for a while: on the H200 one 20-copy loop right after an idle spell measured 3.80 TB/s where the same
    run measured 4.23 TB/s elsewhere, which made every floor of that report 11 % too high."""
    n = nbytes // 2
    src = torch.empty(n, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    best = min(time_per_call(lambda: dst.copy_(src), device, iters=iters, warmup=2 * iters if k == 0 else 1)
               for k in range(repeats))
    return 2 * nbytes / best


def measure_h2d_bandwidth(device: torch.device, nbytes: int = 1 << 28, iters: int = 10) -> float:
    """Pinned host -> device copy rate in bytes/s (the path of a GPU slot fill: one transfer per adapter); on the
    CPU a plain copy."""
    cuda = device.type == "cuda"
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return nbytes / time_per_call(lambda: dst.copy_(src, non_blocking=cuda), device, iters=iters, warmup=2)


def roofline(step: StepBytes, bandwidth: float, measured_step_s: float | None = None) -> dict:
    floor = step.total / bandwidth
    out = {**asdict(step), "total_bytes": step.total, "copy_bandwidth_Bps": bandwidth, "floor_s": floor}
    if measured_step_s is not None:
        out["measured_step_s"] = measured_step_s
        out["measured_over_floor"] = measured_step_s / floor
    return out


def workload_floor(steps: list, shape: ModelShape, rank_of, elem_bytes: int, bandwidth: float,
                   flops_per_s: float | None = None, kv_elem_bytes: float | None = None,
                   weight_quant: str | None = None) -> dict:
    """The floor of a whole run, step by step as the engine scheduled it.

    ``steps``: ``instrument.StepRecord``s (tokens, summed context, distinct adapter ids, sampled rows);
    ``rank_of(adapter_id)`` gives each adapter's real rank. Every step reads all base weights, the A/B of each of
    its distinct adapters and the KV of its sequences' contexts: ``hbm_floor_s`` = Σ bytes ÷ ``bandwidth``. With
    ``flops_per_s`` a step also takes at least ``step_flops`` ÷ that rate (prefill is compute-bound), and
    ``floor_s`` = Σ max(HBM time, compute time); without it ``floor_s`` is the HBM floor."""
    weights = lora = kv = flops = 0
    floor = hbm = 0.0
    compute_bound = 0
    decode = [s for s in steps if s.is_decode]
    for s in steps:
        b = step_bytes(shape, s.num_tokens, s.context_tokens, [rank_of(a) for a in s.lora_ids], elem_bytes,
                       kv_elem_bytes=kv_elem_bytes, weight_quant=weight_quant)
        weights, lora, kv = weights + b.weights, lora + b.lora, kv + b.kv
        step_hbm = b.total / bandwidth
        hbm += step_hbm
        if flops_per_s:
            f = step_flops(shape, s.num_tokens, s.num_sampled)
            flops += f
            compute_bound += f / flops_per_s > step_hbm
            floor += max(step_hbm, f / flops_per_s)
        else:
            floor += step_hbm
    return {
        "num_steps": len(steps), "num_decode_steps": len(decode), "weights_bytes": weights, "lora_bytes": lora,
        "kv_bytes": kv, "total_bytes": weights + lora + kv, "hbm_floor_s": hbm, "floor_s": floor,
        "flops": flops if flops_per_s else None, "flops_per_s": flops_per_s,
        "num_compute_bound_steps": compute_bound if flops_per_s else None,
        "mean_decode_batch": sum(s.num_seqs for s in decode) / len(decode) if decode else None,
        "mean_decode_adapters": sum(len(s.lora_ids) for s in decode) / len(decode) if decode else None,
        "max_step_adapters": max((len(s.lora_ids) for s in steps), default=0),
        "mean_decode_context": (sum(s.context_tokens for s in decode) / sum(s.num_seqs for s in decode)
                                if decode else None),
    }
