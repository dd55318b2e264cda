"""Benchmark workloads: prompt/output lengths and which adapter each request uses (Punica's popularity mixes).

Popularity over N requests (Punica): ``identical`` — one adapter for all; ``zipf`` — adapter i drawn with
probability ∝ 1 / i^1.5 from N candidates; ``uniform`` — √N adapters, each request picks one uniformly;
``distinct`` — every request its own adapter; ``base`` — no adapter. Adapter k is a distinct adapter to
the engine (its own id and slot); its weights come from file ``k % num_files`` so a 1,000-adapter run
needs only a few dozen files on disk (the kernels read each slot's copy all the same).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

POPULARITIES = ("base", "identical", "zipf", "uniform", "distinct")
LENGTH_DISTS = ("fixed", "uniform", "exponential")


@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int
    adapter: int | None  # adapter index (0-based), None = base model


def draw_lengths(n: int, mean: int, dist: str, rng: random.Random, minimum: int = 1) -> list[int]:
    """``fixed``: all ``mean``; ``uniform``: in [mean/2, 3*mean/2]; ``exponential``: mean ``mean``, capped at 4x."""
    if dist == "fixed":
        return [mean] * n
    if dist == "uniform":
        lo, hi = max(minimum, mean // 2), max(minimum, (3 * mean) // 2)
        return [rng.randint(lo, hi) for _ in range(n)]
    if dist == "exponential":
        return [max(minimum, min(4 * mean, round(rng.expovariate(1 / mean)))) for _ in range(n)]
    raise ValueError(f"length distribution must be one of {', '.join(LENGTH_DISTS)} (got {dist!r})")


def assign_adapters(n: int, popularity: str, rng: random.Random, zipf_alpha: float = 1.5) -> list[int | None]:
    if popularity == "base":
        return [None] * n
    if popularity == "identical":
        return [0] * n
    if popularity == "distinct":
        return list(range(n))
    if popularity == "uniform":
        k = max(1, math.isqrt(n))
        return [rng.randrange(k) for _ in range(n)]
    if popularity == "zipf":
        weights = [1.0 / (i + 1) ** zipf_alpha for i in range(n)]
        return rng.choices(range(n), weights=weights, k=n)
    raise ValueError(f"popularity must be one of {', '.join(POPULARITIES)} (got {popularity!r})")


def make_requests(
    n: int, input_len: int, output_len: int, popularity: str, vocab_size: int, seed: int,
    len_dist: str = "fixed", token_floor: int = 10,
) -> list[BenchRequest]:
    """Random prompt token ids in ``[token_floor, vocab_size)`` (past the special tokens)."""
    rng = random.Random(f"{seed}-{popularity}")
    in_lens = draw_lengths(n, input_len, len_dist, rng)
    out_lens = draw_lengths(n, output_len, len_dist, rng)
    adapters = assign_adapters(n, popularity, rng)
    return [
        BenchRequest([rng.randrange(token_floor, vocab_size) for _ in range(li)], lo, a)
        for li, lo, a in zip(in_lens, out_lens, adapters)
    ]


def fresh_prompts(requests: list[BenchRequest], vocab_size: int, seed: int,
                  token_floor: int = 10) -> list[BenchRequest]:
    """The same requests (prompt and output lengths, adapters) with new random prompt tokens: a second run of one
    workload that the first run's prefix cache cannot serve."""
    rng = random.Random(f"fresh-{seed}")
    return [BenchRequest([rng.randrange(token_floor, vocab_size) for _ in r.prompt_token_ids], r.output_len, r.adapter)
            for r in requests]


def num_distinct_adapters(requests: list[BenchRequest]) -> int:
    return len({r.adapter for r in requests if r.adapter is not None})
