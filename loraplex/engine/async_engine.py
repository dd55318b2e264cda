"""AsyncEngine: the ``EngineClient`` the HTTP server uses. The step loop runs in its own thread, so an
HTTP event loop never waits on a model step; requests and aborts reach it through a command queue and
token deltas come back to each caller's event loop.

A request is admitted (``add_requests``) before its stream exists, so a caller learns of a refusal
before it answers anything; the loop thread alone touches the engine: admission runs there too.

If the loop thread dies, every open stream gets a final delta with finish_reason "error", ``is_healthy()``
turns False and new requests raise ``EngineDeadError`` (nothing hangs).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import queue
import sys
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from loraplex.engine.chat import chat_template_ids
from loraplex.engine.config import EngineConfig
from loraplex.engine.engine_core import LLMEngine, check_type, load_tokenizer
from loraplex.engine.protocol import EngineDeadError, EngineRequest, EngineStats, TokenDelta
from loraplex.engine.sampling_params import SamplingParams, snapshots
from loraplex.engine.token_bytes import TokenBytes

log = logging.getLogger(__name__)


LOOP_THREAD_OS_NAME = "lpx-engine-loop"  # as `top -H`, `ps -L` and /proc/<pid>/task/*/comm show the loop thread


def _name_os_thread(name: str) -> None:
    """Give the calling thread an OS-level name (Linux; best effort: elsewhere nothing happens)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(15, name.encode()[:15], 0, 0, 0)  # 15 = PR_SET_NAME
    except (OSError, AttributeError):
        pass


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    num_samples: int
    finished: set[int] = field(default_factory=set)


class StreamingClient:
    """What the thread engine (``AsyncEngine``) and the process engine (``ProcessEngine``) share of the
    ``EngineClient``: the tokenizer here, the requests' snapshots, ``generate`` over ``add_requests``, and aborts as
    commands to the loop (each subclass's ``_send``)."""

    tokenizer: object  # set by each engine's constructor
    _stats: EngineStats

    def _snapshot(self, requests: Sequence[EngineRequest]) -> list[EngineRequest]:
        """Check the requests' params and copy them: each request runs its params as they are now, whatever the
        caller sets on its objects later."""
        for r in requests:
            check_type("sampling_params", r.sampling_params, SamplingParams, "SamplingParams")
        return [dataclasses.replace(r, sampling_params=p)
                for r, p in zip(requests, snapshots([r.sampling_params for r in requests]))]

    async def generate(self, request: EngineRequest) -> AsyncIterator[TokenDelta]:
        """Stream the request's deltas (all ``n`` samples); ends after each sample's final delta. A refused
        request raises on the first iteration (``add_requests`` refuses before anything starts); leaving
        early aborts it."""
        (stream,) = await self.add_requests([request])
        try:
            async for delta in stream:
                yield delta
        finally:
            stream.close()

    async def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def stats(self) -> EngineStats:
        return self._stats

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    @functools.cached_property
    def token_bytes(self) -> TokenBytes:
        """``token_bytes(token_id)``: the token's raw bytes, cached per id (logprobs' ``bytes``)."""
        return TokenBytes(self.tokenizer)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            continue_final_message: bool = False,
                            template_kwargs: dict | None = None) -> list[int]:
        return chat_template_ids(self.tokenizer, messages, add_generation_prompt, continue_final_message,
                                 template_kwargs)


class AsyncEngine(StreamingClient):
    def __init__(self, engine: LLMEngine, model_id: str | None = None):
        self.engine = engine
        self.model_id = model_id or engine.config.model_id or "model"
        self.max_model_len = engine.config.max_model_len
        self.vocab_size = engine.runner.model_config.vocab_size  # token ids the model has an embedding for
        # the loop thread owns the engine's tokenizer; callers get their own instance
        self.tokenizer = load_tokenizer(engine.config.tokenizer or engine.config.model)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._dead: BaseException | None = None
        self._lock = threading.Lock()  # orders commands against the loop's death
        self._stopping = False
        self._stats = engine.get_stats()
        self._loop_steps = 0  # the loop thread's counters (EngineStats.loop_*)
        self._loop_step_s = 0.0
        self._loop_step_cpu_s = 0.0
        self._loop_dispatch_s = 0.0
        self.loop_torch_threads: int | None = None  # torch intra-op threads of the loop thread, once it runs
        self._thread = threading.Thread(target=self._run, name="loraplex-engine-loop", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncEngine:
        return cls(LLMEngine(config), model_id=config.model_id)

    # ---- EngineClient --------------------------------------------------------------------------
    async def add_requests(self, requests: Sequence[EngineRequest]) -> list[RequestStream]:
        """Admit the requests together, or none of them: when the engine refuses one (a ValueError, e.g. a
        ``RequestLimitError`` naming the field), it raises here, before any delta exists, and nothing of the
        group stays in the engine. Returns one open stream per request, in order."""
        self._check_alive()
        requests = self._snapshot(requests)
        loop = asyncio.get_running_loop()
        streams = [_Stream(loop, asyncio.Queue(), r.sampling_params.n) for r in requests]
        added = concurrent.futures.Future()
        self._send(("add", requests, streams, added))
        await asyncio.wrap_future(added)  # cancelled before the loop takes it: the loop adds nothing
        return [RequestStream(self, r.request_id, s) for r, s in zip(requests, streams)]

    def is_healthy(self) -> bool:
        return self._dead is None and self._thread.is_alive()

    async def remove_adapter(self, adapter_id: int) -> None:
        done = concurrent.futures.Future()
        self._send(("remove_adapter", adapter_id, done))
        await asyncio.wrap_future(done)

    async def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        await asyncio.to_thread(self._thread.join, 30)

    # ---- the loop thread -----------------------------------------------------------------------
    def _check_alive(self) -> None:
        if not self.is_healthy():
            raise EngineDeadError(f"the engine loop is not running ({self._dead!r})")

    def _send(self, command: tuple) -> None:
        """Queue a command, or fail its future at once when the loop is gone (never left waiting)."""
        with self._lock:
            if self._dead is None:
                self._commands.put(command)
                self._wake.set()
                return
        future = command[-1]
        if isinstance(future, concurrent.futures.Future):
            future.set_exception(EngineDeadError(f"the engine loop is not running ({self._dead!r})"))

    def _run(self) -> None:
        _name_os_thread(LOOP_THREAD_OS_NAME)
        try:
            import torch

            threads = self.engine.config.loop_torch_threads
            if threads is None:  # EngineConfig.loop_torch_threads: 1 on the CPU, torch's default elsewhere
                threads = 1 if self.engine.runner.device.type == "cpu" else 0
            if threads > 0:
                torch.set_num_threads(threads)  # this thread's (OpenMP's are per thread): EngineConfig.loop_torch_threads
            self.loop_torch_threads = torch.get_num_threads()  # as the loop thread sees it
            while not self._stopping:
                drained = self._drain_commands()
                if self.engine.has_unfinished_requests():
                    started, cpu = time.perf_counter(), time.thread_time()
                    deltas = self.engine.step()
                    stepped = time.perf_counter()
                    self._loop_step_cpu_s += time.thread_time() - cpu
                    self._dispatch(deltas)
                    self._loop_steps += 1
                    self._loop_step_s += stepped - started
                    self._loop_dispatch_s += time.perf_counter() - stepped
                    self._stats = self._loop_stats()
                else:
                    if drained:  # e.g. the last request was aborted: no step follows to refresh the stats
                        self._stats = self._loop_stats()
                    self._wake.wait(timeout=1.0)
                    self._wake.clear()
            reason: BaseException = EngineDeadError("the engine was shut down")
        except BaseException as exc:  # noqa: BLE001 (the loop must report any death, then stop)
            log.exception("engine loop died")
            reason = exc
        with self._lock:
            self._dead = reason
            self._fail_everything(reason)
        try:  # tensor-parallel workers stop with the loop that sent them steps (a no-op for one process)
            self.engine.shutdown()
        except Exception:  # noqa: BLE001
            log.exception("stopping the engine's worker processes failed")

    def _loop_stats(self) -> EngineStats:
        stats = self.engine.get_stats()  # a fresh object each call: filled in here, not copied
        stats.loop_steps, stats.loop_step_seconds = self._loop_steps, self._loop_step_s
        stats.loop_step_cpu_seconds, stats.loop_dispatch_seconds = self._loop_step_cpu_s, self._loop_dispatch_s
        return stats

    def _drain_commands(self) -> bool:
        """Run queued commands; True when there were any."""
        drained = False
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return drained
            drained = True
            kind = command[0]
            if kind == "add":
                _, requests, streams, added = command
                if not added.set_running_or_notify_cancel():
                    continue  # the caller stopped waiting (cancelled): nobody would read or abort these
                try:
                    self._add_all(requests, streams)
                except Exception as exc:  # noqa: BLE001 (a bad request is the caller's error)
                    added.set_exception(exc)
                else:
                    added.set_result(None)
            elif kind == "abort":
                self.engine.abort_request(command[1])
            elif kind == "remove_adapter":
                _, adapter_id, done = command
                try:
                    self.engine.remove_adapter(adapter_id)
                    done.set_result(None)
                except Exception as exc:  # noqa: BLE001
                    done.set_exception(exc)

    def _add_all(self, requests: list[EngineRequest], streams: list[_Stream]) -> None:
        """Add every request of a group, or none; the ids must be free of open streams too."""
        ids = [r.request_id for r in requests]
        check_ids_free(ids, self._streams)
        add_all(self.engine, requests)
        for rid, stream in zip(ids, streams):
            self._streams[rid] = stream  # before any step: no delta can be missed

    def _dispatch(self, deltas: list[TokenDelta]) -> None:
        dispatch(self._streams, deltas)

    def _fail_everything(self, exc: BaseException) -> None:
        message = f"engine loop died: {exc!r}"
        fail_streams(self._streams, message)
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            future = command[-1]
            if isinstance(future, concurrent.futures.Future) and not future.done():
                future.set_exception(EngineDeadError(message))


class RequestStream:
    """The deltas of one admitted request (all ``n`` samples), ending after each sample's final delta.
    ``close()`` before the end aborts the request (an ``async for`` left early does not close it: the
    owner closes it, as ``AsyncEngine.generate`` does); ``drain`` then reads the abort's final deltas."""

    def __init__(self, engine, request_id: str, stream: _Stream):  # engine: AsyncEngine or ProcessEngine
        self.request_id = request_id
        self._engine = engine
        self._stream = stream
        self._finished: set[int] = set()  # as seen here (stream.finished is the loop thread's view)
        self._closed = False

    @property
    def done(self) -> bool:
        return len(self._finished) >= self._stream.num_samples

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> TokenDelta:
        if self.done or self._closed:
            raise StopAsyncIteration
        delta = await self._stream.queue.get()
        if delta.finished:
            self._finished.add(delta.index)
        return delta

    def close(self) -> None:
        if not self._closed and not self.done:
            self._engine._send(("abort", self.request_id))
        self._closed = True

    async def drain(self, timeout_s: float) -> list[TokenDelta]:
        """After ``close()``: the deltas still to come, up to each sample's final one (an abort's says how much
        of the prompt the engine ran), as many as arrive within ``timeout_s``."""
        got: list[TokenDelta] = []

        async def read() -> None:
            while not self.done:
                delta = await self._stream.queue.get()
                if delta.finished:
                    self._finished.add(delta.index)
                got.append(delta)

        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(read(), timeout_s)
        return got


def check_ids_free(ids: list[str], open_streams: dict[str, _Stream]) -> None:
    """Refuse a group whose request ids repeat, or are in use by a stream still waiting for final deltas."""
    for rid in ids:
        if rid in open_streams or ids.count(rid) > 1:
            raise ValueError(f"request_id {rid!r} is already in use")


def add_all(engine: LLMEngine, requests: Sequence[EngineRequest]) -> None:
    """Add every request of a group to the engine, or none: a refusal takes back those added before it (no step
    ran in between, so the engine did no work for them) and raises."""
    added: list[str] = []
    try:
        for r in requests:
            engine.add_request(r.request_id, r.prompt_token_ids, r.sampling_params, lora_request=r.lora_request,
                               cache_salt=r.cache_salt, priority=r.priority, arrival_time=r.arrival_time)
            added.append(r.request_id)
    except Exception:
        for rid in added:  # as if never added, and the id is free again at once
            engine.take_back(rid)
        raise


def dispatch(streams: dict[str, _Stream], deltas: list[TokenDelta]) -> None:
    """Hand a step's deltas to their streams (called off the callers' event loops): one wake-up per event loop
    per step, not one per delta. A stream leaves ``streams`` with its last sample's final delta."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, TokenDelta]]] = {}
    for delta in deltas:
        stream = streams.get(delta.request_id)
        if stream is None:
            continue
        if delta.finished:
            stream.finished.add(delta.index)
            if len(stream.finished) >= stream.num_samples:
                del streams[delta.request_id]
        by_loop.setdefault(stream.loop, []).append((stream.queue, delta))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # the caller's event loop is closed: nobody is listening
            pass


def fail_streams(streams: dict[str, _Stream], message: str) -> None:
    """End every open stream with an "error" final delta for each sample not finished yet."""
    deltas = [TokenDelta(request_id=request_id, index=index, token_ids=[], text="", finished=True,
                         finish_reason="error", error=message)
              for request_id, stream in list(streams.items())
              for index in range(stream.num_samples) if index not in stream.finished]
    dispatch(streams, deltas)
    streams.clear()


def _put_all(items: list[tuple[asyncio.Queue, TokenDelta]]) -> None:
    for q, delta in items:
        q.put_nowait(delta)
