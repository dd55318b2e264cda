"""Device timing: CUDA events around a loop of calls (host clock on the CPU)."""

from __future__ import annotations

import contextlib
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


def time_per_call_graphed(fn: Callable[[], object], device: torch.device, iters: int = 20, warmup: int = 3,
                          replays: int = 5) -> float:
    """Like ``time_per_call`` but with the ``iters`` calls captured in one CUDA graph, timed over ``replays``
    replays: a kernel shorter than its host launch (Triton's launcher costs tens of microseconds from Python) is
    timed on the device, not on the host. The host clock on the CPU."""
    if device.type != "cuda":
        return time_per_call(fn, device, iters, warmup)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):  # warm-up (compiles) on a side stream, as capture wants
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    graph.replay()
    torch.cuda.synchronize(device)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1e3 / (iters * replays)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class SectionClock:
    """Wall time of each named section of a benchmark run, logged as each ends (a run that is cut short
    still shows in its log how far it got and what each part cost)."""

    def __init__(self, logger, prefix: str, on_end=None):
        self.logger = logger
        self.prefix = prefix
        self.walls: dict[str, float] = {}
        self.current: str | None = None  # the section running now
        self.raised_in: str | None = None  # the innermost section an exception (or a stop) left
        self.on_end = on_end  # called with the name of each outermost section that ends without an exception

    @contextlib.contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        outer, self.current = self.current, name
        self.logger.info("%s: %s ...", self.prefix, name)
        try:
            yield
        except BaseException:
            self.raised_in = self.raised_in or name
            raise
        finally:
            self.current = outer
            self.walls[name] = self.walls.get(name, 0.0) + time.perf_counter() - start
            self.logger.info("%s: %s took %.1f s", self.prefix, name, self.walls[name])
        if outer is None and self.on_end is not None:
            self.on_end(name)
