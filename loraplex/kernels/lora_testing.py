"""Random multi-LoRA batches for kernel tests and benchmarks (no Triton import here).

Adapter popularity mixes follow the Punica paper: ``distinct`` (a different adapter per token, as far as
the pool allows), ``uniform`` (random over sqrt(pool) adapters), ``zipf`` (Zipf 1.5 over the pool),
``identical`` (one adapter), ``skewed`` (90% one adapter). A share of tokens is base-only (slot -1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

MIXES = ("distinct", "uniform", "zipf", "identical", "skewed")


@dataclass
class LoRABatch:
    x: torch.Tensor  # [T, K]
    out: torch.Tensor  # [T, N_total]
    lora_a: torch.Tensor  # [num_slots, S, R, K]
    lora_b: torch.Tensor  # [num_slots, R, N_total]
    ranks: torch.Tensor  # [S, num_slots] int32
    scaling: torch.Tensor  # [num_slots] float32
    slice_loc: torch.Tensor  # [S + 1] int32
    token_slots: torch.Tensor  # [T] int32

    @property
    def max_slice_width(self) -> int:
        loc = self.slice_loc.tolist()
        return max(b - a for a, b in zip(loc[:-1], loc[1:]))


def token_slots_for(mix: str, num_tokens: int, num_slots: int, gen: torch.Generator,
                    base_share: float = 0.15) -> torch.Tensor:
    if mix == "distinct":
        slots = torch.randperm(num_tokens, generator=gen) % num_slots
    elif mix == "uniform":
        used = max(1, int(math.isqrt(num_slots)))
        slots = torch.randint(0, used, (num_tokens,), generator=gen)
    elif mix == "zipf":
        weights = 1.0 / torch.arange(1, num_slots + 1, dtype=torch.float64) ** 1.5
        slots = torch.multinomial(weights, num_tokens, replacement=True, generator=gen)
    elif mix == "identical":
        slots = torch.full((num_tokens,), num_slots // 2, dtype=torch.int64)
    elif mix == "skewed":
        slots = torch.where(torch.rand(num_tokens, generator=gen) < 0.9, 0,
                            torch.randint(0, num_slots, (num_tokens,), generator=gen))
    else:
        raise ValueError(f"mix must be one of {MIXES}, got {mix!r}")
    base = torch.rand(num_tokens, generator=gen) < base_share
    return torch.where(base, -1, slots).to(torch.int32)


# (K, slice widths) of each Llama-3-8B projection group the LoRA kernels serve
LLAMA3_GROUPS = {"qkv": (4096, (4096, 1024, 1024)), "o": (4096, (4096,)), "gate_up": (4096, (14336, 14336)),
                 "down": (14336, (4096,))}


def decode_mix_slots(mix: str, gen: torch.Generator, num_tokens: int = 64) -> torch.Tensor:
    """Slots of a decode step of ``num_tokens`` rows on a pool of as many slots: ``"eight"`` = eight adapters with
    equal shares and no base row, otherwise ``token_slots_for(mix, ...)``."""
    if mix == "eight":
        return (torch.randperm(num_tokens, generator=gen) % 8).to(torch.int32)
    return token_slots_for(mix, num_tokens, num_tokens, gen)


def make_lora_batch(
    num_tokens: int,
    k_dim: int,
    slice_widths: tuple[int, ...],
    *,
    num_slots: int = 8,
    max_rank: int = 16,
    slot_ranks: list[list[int]] | None = None,  # [S][num_slots]; default: mixed ranks, some slices 0
    mix: str = "zipf",
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    token_slots: torch.Tensor | None = None,
) -> LoRABatch:
    gen = torch.Generator().manual_seed(seed)
    num_slices = len(slice_widths)
    n_total = sum(slice_widths)
    if slot_ranks is None:
        choices = sorted({max_rank, max(1, max_rank // 2), max(1, (max_rank * 3) // 4), 1})
        slot_ranks = [[choices[int(torch.randint(0, len(choices), (1,), generator=gen))]
                       for _ in range(num_slots)] for _ in range(num_slices)]
        if num_slices > 1:  # an adapter that skips one slice of the fused projection
            slot_ranks[1][1 % num_slots] = 0
    # every entry (padding included) is random: a kernel reading past a slot's rank shows up
    lora_a = torch.randn(num_slots, num_slices, max_rank, k_dim, generator=gen) / math.sqrt(k_dim)
    lora_b = torch.randn(num_slots, max_rank, n_total, generator=gen) / math.sqrt(max_rank)
    scaling = 0.5 + torch.rand(num_slots, generator=gen)
    if token_slots is None:
        token_slots = token_slots_for(mix, num_tokens, num_slots, gen)
    loc = [0]
    for w in slice_widths:
        loc.append(loc[-1] + w)
    return LoRABatch(
        x=torch.randn(num_tokens, k_dim, generator=gen).to(device=device, dtype=dtype),
        out=torch.randn(num_tokens, n_total, generator=gen).to(device=device, dtype=dtype),
        lora_a=lora_a.to(device=device, dtype=dtype),
        lora_b=lora_b.to(device=device, dtype=dtype),
        ranks=torch.tensor(slot_ranks, dtype=torch.int32, device=device),
        scaling=scaling.to(device=device, dtype=torch.float32),
        slice_loc=torch.tensor(loc, dtype=torch.int32, device=device),
        token_slots=token_slots.to(device=device, dtype=torch.int32),
    )


def random_slot_pool(shapes, num_slots: int, max_rank: int, device, dtype, seed: int = 0, std: float = 0.08):
    """A ``SlotPool`` whose every slot holds random weights, real ranks drawn from 1..max_rank per slot and module
    and scalings in [0.5, 1.5); returns it with the generator (on ``device``) that drew them, for more inputs."""
    from loraplex.adapters.slot_pool import SlotPool

    device = torch.device(device)
    pool = SlotPool(shapes, num_slots, max_rank, device, dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    for t in (*pool.a.values(), *pool.bt.values()):
        t.normal_(0.0, std, generator=gen)
    pool.ranks.copy_(torch.randint(1, max_rank + 1, pool.ranks.shape, generator=gen, device=device, dtype=torch.int32))
    pool.scaling.copy_(torch.rand(num_slots, generator=gen, device=device) + 0.5)
    return pool, gen


def capture_cuda_graph(fn) -> torch.cuda.CUDAGraph:
    """``fn`` run once on a side stream (compiles kernels, warms the allocator), then captured into a CUDA graph,
    as the engine captures its decode steps."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph
