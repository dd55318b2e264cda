"""Integer helpers for the kernels' host-side launch code.

``triton.cdiv`` and ``triton.next_power_of_2`` are Triton constexpr functions: every call from Python goes through
a wrapper that unwraps constexpr arguments, a few microseconds each. The launch wrappers call them several times per
launch, hundreds of launches per eager step (H200 run 11, docs/benchmarks/H200-2026-12-02-run11.md), so the host side
uses these plain versions (same results for the non-negative sizes it passes; tests/unit/kernels/test_host_math.py).
"""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling of a / b for b > 0 (as ``triton.cdiv``)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n for n >= 1; 0 for 0 (as ``triton.next_power_of_2``)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0
