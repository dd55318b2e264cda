"""The start-up warm-up's LoRA steps (``mapping.warmup_steps``) meet every set of compiled kernel variants that an
eager serving step can need, so no request waits for a Triton compile. Host arithmetic only: the keys are what
``LoRAStep`` hands its kernels as compile-time constants (``step_compile_key``)."""

from __future__ import annotations

import random

import pytest

from loraplex.adapters.mapping import StepKernelOptions, step_compile_key, warmup_steps
from loraplex.adapters.modules import BaseShapes

LLAMA3_8B = BaseShapes(num_layers=32, hidden_size=4096, q_size=4096, kv_size=1024, intermediate_size=14336)


def _keys(opts, cases):
    return {step_compile_key(LLAMA3_8B, opts, t, n, base, long) for t, n, base, long in cases}


@pytest.mark.parametrize("opts, budget", [
    (StepKernelOptions(256, 16, pdl=True, expand_first_min_tokens=128), 8192),  # the bench's engine
    (StepKernelOptions(256, 16, pdl=True, expand_first_min_tokens=128, silu_mul_min_tokens=2048,
                       segment_tiles=True), 8192),
    (StepKernelOptions(256, 16, pdl=True, expand_first_min_tokens=128, fold_shrink_max_tokens=256), 8192),
    (StepKernelOptions(64, 64, expand_first_min_tokens=128), 16384),
    (StepKernelOptions(8, 16, expand_first_min_tokens=0), 4096),
])
def test_every_eager_step_runs_kernels_the_warm_up_compiled(opts, budget):
    warm = _keys(opts, warmup_steps(LLAMA3_8B, opts, budget))
    rng = random.Random(7)
    steps = [(budget, opts.max_loras), (budget, 1), (budget - 1, opts.max_loras - 1), (1, 1)]
    steps += [(t, rng.randint(1, min(t, opts.max_loras))) for t in (rng.randint(1, budget) for _ in range(1500))]
    for t, n in steps:
        for base in (True, False):
            for long in (None, t, t // 3):
                assert step_compile_key(LLAMA3_8B, opts, t, n, base, long) in warm, (t, n, base, long)


def test_distinct_prompt_steps_need_a_case_the_former_warm_up_lacked():
    """The H200 report of 2026-12-07 compiled a shrink and an expand inside distinct's timed run: its prompt steps
    (8,192 tokens on ~250 adapters, every token with one) take prefill tiles with one K part, while the former
    warm-up (budget and budget - 1 tokens on 1 and ``max_loras`` adapters, base rows present) ran prefill tiles
    in two K parts only (one adapter) and decode tiles (256 adapters: 32 tokens each)."""
    opts = StepKernelOptions(256, 16, pdl=True, expand_first_min_tokens=128)
    former = _keys(opts, [(t, n, True, None) for t in (8192, 8191) for n in (1, 256)])
    distinct_prompt_step = step_compile_key(LLAMA3_8B, opts, 8192, 250, False, None)
    assert distinct_prompt_step not in former
    assert distinct_prompt_step in _keys(opts, warmup_steps(LLAMA3_8B, opts, 8192))


def test_warm_up_steps_are_few_and_within_the_budget():
    opts = StepKernelOptions(256, 16, pdl=True, expand_first_min_tokens=128)
    cases = warmup_steps(LLAMA3_8B, opts, 8192)
    assert 1 < len(cases) <= 12
    assert all(1 <= n <= min(t, 256) <= t <= 8192 for t, n, _, _ in cases)
    assert len(_keys(opts, cases)) == len(cases)  # one step per key
    assert warmup_steps(LLAMA3_8B, opts, 0) == []
