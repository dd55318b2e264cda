"""Background adapter reads: disk read, validation and slot layout off the engine thread.

The engine thread submits one job per file identity (``file_cache.file_key``); a small thread pool runs the
read (safetensors, numpy/torch validation and layout, which release the GIL for most of their time) and
queues the result; the engine thread takes finished results at the start of a step (``take_done``). The
results list is the only state shared with the workers (under a condition variable): every other piece of
adapter bookkeeping is read and written on the engine thread alone.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any


@dataclass
class LoadResult:
    key: Hashable  # the file identity the read was submitted under
    path: str
    adapter: Any | None  # the packed host adapter; None when the read failed
    error: Exception | None
    seconds: float  # wall time of the read on its worker


class BackgroundLoader:
    def __init__(self, read: Callable[[str], Any], num_workers: int) -> None:
        if num_workers < 1:
            raise ValueError(f"num_load_workers must be >= 1, got {num_workers}")
        self._read = read
        self.num_workers = num_workers
        self._pool = ThreadPoolExecutor(num_workers, thread_name_prefix="loraplex-adapter-load")
        self._cond = threading.Condition()
        self._done: list[LoadResult] = []
        self.num_in_flight = 0  # submitted and not yet taken (engine thread only)
        # Fault injection, for tests only: called on the worker with the path before each read, so a test
        # can make one adapter's read slow (or hold it until the test releases it). None in production.
        self.fault_injection_before_read: Callable[[str], None] | None = None

    def submit(self, key: Hashable, path: str) -> None:
        self.num_in_flight += 1
        self._pool.submit(self._run, key, path)

    def _run(self, key: Hashable, path: str) -> None:
        started = time.perf_counter()
        adapter, error = None, None
        try:
            hook = self.fault_injection_before_read
            if hook is not None:
                hook(path)
            adapter = self._read(path)
        except Exception as exc:  # noqa: BLE001 (any failure fails the requests waiting for this file)
            error = exc
        result = LoadResult(key, path, adapter, error, time.perf_counter() - started)
        with self._cond:
            self._done.append(result)
            self._cond.notify_all()

    def take_done(self) -> list[LoadResult]:
        """Finished reads since the last call, in completion order."""
        with self._cond:
            done, self._done = self._done, []
        self.num_in_flight -= len(done)
        return done

    def wait(self, timeout: float) -> bool:
        """Block until some read has finished, at most ``timeout`` s; False at once when none is in flight."""
        if not self.num_in_flight:
            return False
        with self._cond:
            return self._cond.wait_for(lambda: bool(self._done), timeout)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
