"""Fault injection for tests: adapter reads of chosen directories block on their loader worker until the
test releases them (``BackgroundLoader.fault_injection_before_read``). Nothing else is replaced: the read,
validation and every bookkeeping step after it are the real ones."""

from __future__ import annotations

import os
import threading


class HeldReads:
    def __init__(self, *paths: str) -> None:
        self.paths = {os.path.realpath(p) for p in paths}
        self.started = threading.Event()  # a held read has begun (and is waiting)
        self._released = threading.Event()

    def __call__(self, path: str) -> None:
        if os.path.realpath(path) in self.paths:
            self.started.set()
            if not self._released.wait(30):
                raise TimeoutError(f"held read of {path} was never released")

    def release(self) -> None:
        self._released.set()


def hold(manager, *paths: str) -> HeldReads:
    """Hold the reads of ``paths`` in this manager's loader until ``release()``."""
    held = HeldReads(*paths)
    manager.loader.fault_injection_before_read = held
    return held
