"""AsyncEngine: the ``EngineClient`` the HTTP server uses. The step loop runs in its own thread, so an
HTTP event loop never waits on a model step; requests and aborts reach it through a command queue and
token deltas come back to each caller's event loop.

If the loop thread dies, every open stream gets a final delta with finish_reason "error", ``is_healthy()``
turns False and new requests raise ``EngineDeadError`` (nothing hangs).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from loraplex.engine.config import EngineConfig
from loraplex.engine.engine_core import LLMEngine, load_tokenizer
from loraplex.engine.protocol import EngineDeadError, EngineRequest, EngineStats, TokenDelta

log = logging.getLogger(__name__)


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    num_samples: int
    finished: set[int] = field(default_factory=set)


class AsyncEngine:
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
        self._thread = threading.Thread(target=self._run, name="loraplex-engine-loop", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncEngine:
        return cls(LLMEngine(config), model_id=config.model_id)

    # ---- EngineClient --------------------------------------------------------------------------
    async def generate(self, request: EngineRequest) -> AsyncIterator[TokenDelta]:
        """Stream the request's deltas (all ``n`` samples); ends after each sample's final delta.
        A bad request raises ValueError before anything is streamed; leaving early aborts it."""
        self._check_alive()
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), request.sampling_params.n)
        added = concurrent.futures.Future()
        self._send(("add", request, stream, added))
        await asyncio.wrap_future(added)
        finished: set[int] = set()  # as seen here (stream.finished is the loop thread's view)
        done = False
        try:
            while not done:
                delta = await stream.queue.get()
                if delta.finished:
                    finished.add(delta.index)
                    done = len(finished) >= stream.num_samples
                yield delta
        finally:
            if not done:
                self._send(("abort", request.request_id))

    async def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def is_healthy(self) -> bool:
        return self._dead is None and self._thread.is_alive()

    def stats(self) -> EngineStats:
        return self._stats

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            continue_final_message: bool = False) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                 continue_final_message=continue_final_message, tokenize=True)
        if hasattr(ids, "keys"):  # a BatchEncoding in newer transformers
            ids = ids["input_ids"]
        return list(ids)

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
        try:
            while not self._stopping:
                drained = self._drain_commands()
                if self.engine.has_unfinished_requests():
                    self._dispatch(self.engine.step())
                    self._stats = self.engine.get_stats()
                else:
                    if drained:  # e.g. the last request was aborted: no step follows to refresh the stats
                        self._stats = self.engine.get_stats()
                    self._wake.wait(timeout=1.0)
                    self._wake.clear()
            reason: BaseException = EngineDeadError("the engine was shut down")
        except BaseException as exc:  # noqa: BLE001 (the loop must report any death, then stop)
            log.exception("engine loop died")
            reason = exc
        with self._lock:
            self._dead = reason
            self._fail_everything(reason)

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
                _, request, stream, added = command
                if request.request_id in self._streams:  # open (or its final deltas not yet delivered)
                    added.set_exception(ValueError(f"request_id {request.request_id!r} is already in use"))
                    continue
                try:
                    self.engine.add_request(
                        request.request_id, request.prompt_token_ids, request.sampling_params,
                        lora_request=request.lora_request, cache_salt=request.cache_salt,
                        priority=request.priority, arrival_time=request.arrival_time)
                except Exception as exc:  # noqa: BLE001 (a bad request is the caller's error)
                    added.set_exception(exc)  # the stream of another request with this id stays
                else:
                    self._streams[request.request_id] = stream  # before any step: no delta can be missed
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

    def _dispatch(self, deltas: list[TokenDelta]) -> None:
        for delta in deltas:
            stream = self._streams.get(delta.request_id)
            if stream is None:
                continue
            if delta.finished:
                stream.finished.add(delta.index)
                if len(stream.finished) >= stream.num_samples:
                    del self._streams[delta.request_id]
            _put(stream, delta)

    def _fail_everything(self, exc: BaseException) -> None:
        message = f"engine loop died: {exc!r}"
        for request_id, stream in list(self._streams.items()):
            for index in range(stream.num_samples):
                if index not in stream.finished:
                    _put(stream, TokenDelta(request_id=request_id, index=index, token_ids=[], text="",
                                            finished=True, finish_reason="error", error=message))
        self._streams.clear()
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            future = command[-1]
            if isinstance(future, concurrent.futures.Future) and not future.done():
                future.set_exception(EngineDeadError(message))


def _put(stream: _Stream, delta: TokenDelta) -> None:
    try:
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, delta)
    except RuntimeError:  # the caller's event loop is closed: nobody is listening
        pass
