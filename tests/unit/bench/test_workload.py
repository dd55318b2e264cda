"""Benchmark workloads: Punica's popularity mixes and length distributions."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from loraplex.bench.workload import assign_adapters, draw_lengths, make_requests, num_distinct_adapters


def test_popularity_mixes_have_the_right_number_of_adapters():
    n = 1000
    rng = random.Random(0)
    assert set(assign_adapters(n, "base", rng)) == {None}
    assert set(assign_adapters(n, "identical", rng)) == {0}
    assert sorted(assign_adapters(n, "distinct", rng)) == list(range(n))
    uniform = assign_adapters(n, "uniform", rng)
    assert len(set(uniform)) <= math.isqrt(n) and len(set(uniform)) >= math.isqrt(n) - 3
    zipf = Counter(assign_adapters(n, "zipf", rng))
    # P(adapter 0) = 1 / H(n, 1.5) ~ 0.38: the head dominates, the tail is long
    assert 0.3 < zipf[0] / n < 0.46 and zipf[0] > zipf[1] > zipf[3]
    assert len(zipf) > 50


def test_length_distributions_and_bounds():
    rng = random.Random(1)
    assert draw_lengths(5, 100, "fixed", rng) == [100] * 5
    uni = draw_lengths(500, 100, "uniform", rng)
    assert min(uni) >= 50 and max(uni) <= 150
    exp = draw_lengths(2000, 100, "exponential", rng)
    assert min(exp) >= 1 and max(exp) <= 400 and 80 < sum(exp) / len(exp) < 120
    with pytest.raises(ValueError, match="length distribution"):
        draw_lengths(1, 1, "normal", rng)


def test_requests_are_seeded_and_within_vocab():
    a = make_requests(20, 30, 7, "zipf", vocab_size=500, seed=3, len_dist="uniform")
    b = make_requests(20, 30, 7, "zipf", vocab_size=500, seed=3, len_dist="uniform")
    assert [r.prompt_token_ids for r in a] == [r.prompt_token_ids for r in b]
    assert all(10 <= t < 500 for r in a for t in r.prompt_token_ids)
    c = make_requests(20, 30, 7, "distinct", vocab_size=500, seed=3)
    assert num_distinct_adapters(c) == 20
    assert [r.prompt_token_ids for r in c] != [r.prompt_token_ids for r in a[: len(c)]]
