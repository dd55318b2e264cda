"""Device timing: CUDA events around a loop of calls (host clock on the CPU)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def time_per_call(fn: Callable[[], object], device: torch.device, iters: int = 20, warmup: int = 3) -> float:
    """Mean seconds per call of ``fn`` over ``iters`` back-to-back calls, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) / iters
    torch.cuda.synchronize(device)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1e3 / iters


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
