"""ProcessEngine: the ``EngineClient`` with the engine's step loop in a child process of its own.

In ``AsyncEngine`` the loop thread shares the server's GIL with the HTTP event loop. Every kernel launch and
every wait for the device lets the GIL go, and each time the event loop holds it (streaming tokens, parsing
requests) the engine waits up to a switch interval to get it back: on the H200 the server's steps took 47 ms,
26 ms of it on a CPU, where the same steps offline take 14 (docs/benchmarks). Here the engine has a process,
and a GIL, to itself; the server keeps the tokenizer (prompts are tokenized there, texts come back detokenized).

Transport: one ``multiprocessing`` pipe (a socket pair private to the two processes). The server sends
commands (add, abort, remove an adapter, shut down) through a writer thread, so no event loop ever blocks on a
full pipe; a reader thread receives each step's deltas and the engine's stats in one message and wakes each
caller's event loop once per step. Replies to "add" carry the refusal itself (``SamplingParamsError`` and
``RequestLimitError`` keep their field and limit).

The child ignores SIGINT and SIGTERM (a Ctrl-C, or systemd's stop, reaches every process of the group; the
server drains, then stops it) and exits when the pipe closes, so a server that dies without stopping it does not leave it holding the GPU.
A server that exits without closing the engine (a second Ctrl-C skips the app's shutdown) stops it at interpreter
exit, before ``multiprocessing`` joins its children: that join would otherwise wait for a child that waits for
the pipe to close.
If the child dies, every open stream ends with an "error" delta, ``is_healthy()`` turns False and new requests
raise ``EngineDeadError``, as with the loop thread.

Liveness: the child sends something at least every ``HEARTBEAT_S`` while idle (its stats) and after every step, so
``silent_s()`` (seconds since the child last sent anything) grows only while a step runs or the child is stuck: a
device hang, a stopped process, a deadlock. The server's supervisor ``kill()``s a child silent for longer than its
stall timeout, which then dies as above and is replaced (loraplex/platform/engine_boot.py).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import itertools
import logging
import multiprocessing
import os
import pickle
import queue
import signal
import threading
import time
import weakref
from collections.abc import Sequence

from loraplex.engine.async_engine import (
    LOOP_THREAD_OS_NAME,
    RequestStream,
    StreamingClient,
    _name_os_thread,
    _Stream,
    add_all,
    check_ids_free,
    dispatch,
    fail_streams,
)
from loraplex.engine.config import EngineConfig
from loraplex.engine.engine_core import load_tokenizer
from loraplex.engine.protocol import EngineDeadError, EngineRequest, EngineStats
from loraplex.log import current_log_format, setup_child_logging

log = logging.getLogger(__name__)

START_TIMEOUT_S = 1800.0  # loading an 8B model from a slow disk, plus CUDA graph capture
EXIT_STOP_TIMEOUT_S = 5.0  # at interpreter exit, how long the child may take to stop before it is killed
HEARTBEAT_S = 1.0  # an idle child sends its stats this often
# a child silent this long when it is asked to stop is not stepping (a step is far shorter): it gets this long to
# stop before it is killed, instead of the full close timeout
STALLED_CLOSE_S = 5.0


class ProcessEngine(StreamingClient):
    """``EngineClient`` over an engine in a child process (started here; blocks until its model has loaded)."""

    def __init__(self, config: EngineConfig, model_id: str | None = None, *, freeze_gc: bool = False,
                 start_timeout_s: float = START_TIMEOUT_S, stalled_close_s: float = STALLED_CLOSE_S):
        ctx = multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
        self._conn, child_conn = ctx.Pipe(duplex=True)
        self._proc = ctx.Process(
            target=_child_main, name="loraplex-engine", daemon=False,  # daemonic processes may not start TP workers
            args=(config, child_conn, os.getpid(), logging.getLogger().getEffectiveLevel(), current_log_format(),
                  freeze_gc))
        self._proc.start()
        child_conn.close()  # the child's end lives in the child alone: its exit closes the pipe here
        # the tokenizer (transformers' import, then the files) loads here while the child loads the model
        tokenizer = concurrent.futures.ThreadPoolExecutor(1, "loraplex-tokenizer-load")
        tokenizer_loaded = tokenizer.submit(load_tokenizer, config.tokenizer or config.model)
        tokenizer.shutdown(wait=False)
        try:
            info = self._await_ready(start_timeout_s)
            self.tokenizer = tokenizer_loaded.result()
        except BaseException:
            self._stop_child(timeout_s=5.0)
            self._conn.close()
            raise
        self.model_id = model_id or config.model_id or info["model_id"]
        self.max_model_len = info["max_model_len"]
        self.vocab_size = info["vocab_size"]
        self.pid = self._proc.pid
        self._stats: EngineStats = info["stats"]
        self._streams: dict[str, _Stream] = {}
        self._replies: dict[int, concurrent.futures.Future] = {}
        self._tokens = itertools.count()
        self._dead: BaseException | None = None
        self._heard_at = time.monotonic()  # when the child last sent anything (the reader thread sets it)
        self._kill_reason: str | None = None
        self._stalled_close_s = stalled_close_s
        self._lock = threading.Lock()  # orders streams, replies and sends against the child's death
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_loop, name="loraplex-engine-writer", daemon=True)
        self._reader = threading.Thread(target=self._read_loop, name="loraplex-engine-reader", daemon=True)
        self._writer.start()
        self._reader.start()
        self._closed = False
        self._at_exit = _close_at_exit(weakref.ref(self))
        atexit.register(self._at_exit)

    @classmethod
    def from_config(cls, config: EngineConfig, **kwargs) -> ProcessEngine:
        return cls(config, model_id=config.model_id, **kwargs)

    # ---- EngineClient --------------------------------------------------------------------------
    async def add_requests(self, requests: Sequence[EngineRequest]) -> list[RequestStream]:
        """As ``AsyncEngine.add_requests``: all admitted, or a refusal raised here and none kept."""
        self._check_alive()
        requests = self._snapshot(requests)
        loop = asyncio.get_running_loop()
        ids = [r.request_id for r in requests]
        streams = [_Stream(loop, asyncio.Queue(), r.sampling_params.n) for r in requests]
        with self._lock:
            self._check_alive()
            check_ids_free(ids, self._streams)
            # open before the child can step them: no delta arrives for a stream not yet here
            self._streams.update(zip(ids, streams))
        try:
            await self._call("add", requests)
        except BaseException as exc:
            with self._lock:
                for rid, stream in zip(ids, streams):
                    if self._streams.get(rid) is stream:
                        del self._streams[rid]
            if not isinstance(exc, Exception):  # cancelled: the child may have admitted them; nobody reads them
                for rid in ids:
                    self._send(("abort", rid))
            raise
        return [RequestStream(self, r.request_id, s) for r, s in zip(requests, streams)]

    def is_healthy(self) -> bool:
        return self._dead is None and self._proc.is_alive()

    def silent_s(self) -> float:
        """Seconds since the child last sent anything (0 once it is dead: then ``is_healthy`` says so). An idle
        child sends every ``HEARTBEAT_S``, a busy one after each step: a long silence is a stuck engine."""
        return 0.0 if self._dead is not None else max(0.0, time.monotonic() - self._heard_at)

    def kill(self, reason: str) -> None:
        """End a stuck child now (SIGKILL: it runs no more code); its streams and callers fail with ``reason``."""
        self._kill_reason = reason
        if self._proc.is_alive():
            self._proc.kill()

    async def remove_adapter(self, adapter_id: int) -> None:
        await self._call("remove_adapter", adapter_id)

    async def shutdown(self) -> None:
        await asyncio.to_thread(self.close)

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the child (it ends open streams as shut down), wait for it, then stop the threads here."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._at_exit)
        self._send(("shutdown",))
        if self.silent_s() > self._stalled_close_s:  # stuck: it would not read the shutdown command in time anyway
            timeout_s = min(timeout_s, self._stalled_close_s)
        self._stop_child(timeout_s)
        self._reader.join(5.0)
        self._mark_dead(EngineDeadError("the engine was shut down"))
        self._outbox.put(None)
        self._writer.join(5.0)
        self._conn.close()

    # ---- the server's side of the pipe ---------------------------------------------------------
    def _check_alive(self) -> None:
        if not self.is_healthy():
            raise EngineDeadError(f"the engine process is not running ({self._dead!r})")

    def _send(self, command: tuple) -> None:
        if self._dead is None:
            self._outbox.put(command)

    async def _call(self, kind: str, *args):
        """Send a command that the child answers; raises what the child raised."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._dead is not None:
                raise EngineDeadError(f"the engine process is not running ({self._dead!r})")
            token = next(self._tokens)
            self._replies[token] = future
        self._send((kind, token, *args))
        try:
            return await asyncio.wrap_future(future)
        finally:
            with self._lock:
                self._replies.pop(token, None)

    def _await_ready(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while not self._conn.poll(min(1.0, max(0.0, deadline - time.monotonic()))):
            if not self._proc.is_alive():
                raise EngineDeadError(f"the engine process exited with code {self._proc.exitcode} while loading")
            if time.monotonic() >= deadline:
                raise TimeoutError(f"the engine process did not load within {timeout_s:g} s")
        try:
            kind, payload = self._conn.recv()
        except (EOFError, OSError) as exc:
            raise EngineDeadError(f"the engine process exited with code {self._proc.exitcode} while loading") from exc
        if kind == "failed":
            raise _load_exception(payload)
        return payload

    def _write_loop(self) -> None:
        while (command := self._outbox.get()) is not None:
            try:
                self._conn.send(command)
            except (OSError, ValueError):  # the child is gone (the reader reports it) or the pipe closed
                return

    def _read_loop(self) -> None:
        reason: BaseException = EngineDeadError("the engine process exited")
        try:
            while True:
                message = self._conn.recv()
                self._heard_at = time.monotonic()
                kind = message[0]
                if kind == "step":
                    _, deltas, self._stats = message
                    with self._lock:
                        dispatch(self._streams, deltas)
                elif kind == "stats":
                    self._stats = message[1]
                elif kind == "reply":
                    _, token, error, result = message
                    with self._lock:
                        future = self._replies.get(token)
                    if future is not None and future.set_running_or_notify_cancel():
                        if error is None:
                            future.set_result(result)
                        else:
                            future.set_exception(_load_exception(error))
                elif kind == "dead":
                    reason = EngineDeadError(message[1])
                    break
        except (EOFError, OSError):
            self._proc.join(2.0)  # the pipe closes as the child dies: reap it, so its exit code is known
            code = self._proc.exitcode
            reason = EngineDeadError(self._kill_reason or ("the engine process exited" if code is None else
                                                           f"the engine process exited ({_exit_text(code)})"))
        except Exception as exc:  # noqa: BLE001 (a message this side cannot read: the engine is unusable)
            log.exception("reading from the engine process failed")
            reason = exc
        self._mark_dead(reason)

    def _mark_dead(self, reason: BaseException) -> None:
        with self._lock:
            if self._dead is None:
                self._dead = reason
            fail_streams(self._streams, f"engine loop died: {self._dead!r}")
            replies, self._replies = self._replies, {}
        for future in replies.values():
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineDeadError(f"the engine process is not running ({self._dead!r})"))

    def _stop_child(self, timeout_s: float) -> None:
        self._proc.join(timeout_s)
        if self._proc.is_alive():  # it ignores SIGTERM (see _child_main)
            log.warning("the engine process did not stop within %.0f s; killing it", timeout_s)
            self._proc.kill()
            self._proc.join(5.0)


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _close_at_exit(ref):
    """The atexit hook of one ProcessEngine (a weak reference: the hook does not keep a dropped engine alive)."""

    def close() -> None:
        engine = ref()
        if engine is not None and not engine._closed:
            log.warning("the server exits without having stopped the engine process; stopping it now")
            engine.close(timeout_s=EXIT_STOP_TIMEOUT_S)

    return close


# ---- the child -----------------------------------------------------------------------------------
def _dump_exception(exc: BaseException) -> bytes:
    """The refusal as the caller should see it; anything that does not survive pickling becomes a ValueError
    (a refused request) or a RuntimeError with its text."""
    try:
        data = pickle.dumps(exc)
        pickle.loads(data)
        return data
    except Exception:  # noqa: BLE001
        kind = ValueError if isinstance(exc, ValueError) else RuntimeError
        return pickle.dumps(kind(f"{type(exc).__name__}: {exc}"))


def _load_exception(data: bytes) -> BaseException:
    return pickle.loads(data)  # from our own child over a private pipe, never from a client


def _child_main(config: EngineConfig, conn, parent_pid: int, log_level: int, log_format: str,
                freeze_gc: bool) -> None:
    # a Ctrl-C reaches the whole process group, and systemd's stop sends SIGTERM to every process of the unit: the
    # server drains its requests first, then stops this process itself (or it exits when the server's pipe closes)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _name_os_thread(LOOP_THREAD_OS_NAME)
    setup_child_logging(log_level, log_format, "engine")
    try:
        from loraplex.engine.engine_core import LLMEngine

        engine = LLMEngine(config)
        if engine.tp_driver is not None:
            engine.tp_driver.on_worker_death = _exit_on_worker_death(engine.tp_driver)
        threads = config.loop_torch_threads
        if threads is None:
            threads = 1 if engine.runner.device.type == "cpu" else 0
        if threads > 0:
            import torch

            torch.set_num_threads(threads)
        if freeze_gc:
            from loraplex.engine.gc_heap import freeze_heap

            freeze_heap()
        conn.send(("ready", {"model_id": engine.config.model_id or "model",
                             "max_model_len": engine.config.max_model_len,
                             "vocab_size": engine.runner.model_config.vocab_size, "stats": engine.get_stats()}))
    except BaseException as exc:  # noqa: BLE001 (the server reports the load failure)
        log.exception("the engine failed to load")
        try:
            conn.send(("failed", _dump_exception(exc)))
        except OSError:
            pass
        return
    _ChildLoop(engine, conn, parent_pid).run()


def _exit_on_worker_death(driver):
    """A dead tensor-parallel worker leaves this rank blocked in its next collective. In a thread of the server, the
    driver stops the whole server (SIGTERM to itself); here, the engine process ends its other workers and exits, the
    server sees its pipe close, fails the open streams and its supervisor starts a new engine."""

    def exit_now() -> None:
        log.critical("tensor parallel: a worker died; the engine process exits (the server starts a new engine)")
        for proc in driver.procs:
            if proc.is_alive():
                proc.kill()
        os._exit(70)  # the loop may be blocked inside a collective: no clean way out of it

    return exit_now


class _ChildLoop:
    """AsyncEngine's loop with the pipe in place of the streams: commands between steps, each step's deltas
    and stats sent as one message."""

    def __init__(self, engine, conn, parent_pid: int):
        self.engine, self.conn, self.parent_pid = engine, conn, parent_pid
        self.stopping = False
        self.sent_at = time.monotonic()
        self.steps = 0
        self.step_s = self.step_cpu_s = self.send_s = 0.0

    def run(self) -> None:
        reason = "the engine was shut down"
        try:
            while not self.stopping:
                busy = self.engine.has_unfinished_requests()
                drained = self._drain(timeout_s=0.0 if busy else 1.0)
                if self.stopping:
                    break
                if self.engine.has_unfinished_requests():
                    started, cpu = time.perf_counter(), time.thread_time()
                    deltas = self.engine.step()
                    stepped = time.perf_counter()
                    self.step_cpu_s += time.thread_time() - cpu
                    self.steps += 1
                    self.step_s += stepped - started
                    self.conn.send(("step", deltas, self._stats()))
                    self.sent_at = time.monotonic()
                    self.send_s += time.perf_counter() - stepped
                elif not drained and os.getppid() != self.parent_pid:  # the server is gone (its end of the pipe
                    return  # may be inherited)
                elif drained or time.monotonic() - self.sent_at >= HEARTBEAT_S:
                    # drained: e.g. the last request was aborted, and no step follows to refresh the stats; idle: the
                    # heartbeat that tells the server this loop still runs (ProcessEngine.silent_s)
                    self.conn.send(("stats", self._stats()))
                    self.sent_at = time.monotonic()
        except (EOFError, BrokenPipeError, ConnectionResetError):
            return  # the server closed the pipe: nobody to report to
        except BaseException as exc:  # noqa: BLE001 (the loop must report any death, then stop)
            log.exception("engine loop died")
            reason = f"engine loop died: {exc!r}"
        finally:
            try:
                self.engine.shutdown()
            except Exception:  # noqa: BLE001
                log.exception("stopping the engine's worker processes failed")
        try:
            self.conn.send(("dead", reason))
        except OSError:
            pass

    def _stats(self) -> EngineStats:
        stats = self.engine.get_stats()
        stats.loop_steps, stats.loop_step_seconds = self.steps, self.step_s
        stats.loop_step_cpu_seconds, stats.loop_dispatch_seconds = self.step_cpu_s, self.send_s
        return stats

    def _drain(self, timeout_s: float) -> bool:
        drained = False
        while self.conn.poll(timeout_s):
            timeout_s = 0.0
            drained = True
            command = self.conn.recv()
            kind = command[0]
            if kind == "add":
                _, token, requests = command
                self._answer(token, add_all, self.engine, requests)
            elif kind == "abort":
                self.engine.abort_request(command[1])
            elif kind == "remove_adapter":
                _, token, adapter_id = command
                self._answer(token, self.engine.remove_adapter, adapter_id)
            elif kind == "shutdown":
                self.stopping = True
                return drained
        return drained

    def _answer(self, token: int, fn, *args) -> None:
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 (a refusal is the caller's error; the loop goes on)
            self.conn.send(("reply", token, _dump_exception(exc), None))
        else:
            self.conn.send(("reply", token, None, None))
