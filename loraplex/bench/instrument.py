"""Bench-owned instrumentation of a live engine: its bound methods are wrapped for a while, then restored.

Nothing in ``loraplex.engine`` changes. ``patched`` swaps attributes of live objects (instance methods, callable
attributes, a module's function) and puts the originals back. ``ScheduleRecorder`` keeps what every step held
(sequences, tokens, context, distinct adapters); ``PhaseTimers`` times each phase of ``LLMEngine.step()``.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass


@contextlib.contextmanager
def patched(replacements: list[tuple[object, str, Callable[[Callable], Callable]]]) -> Iterator[None]:
    """``(owner, attribute, make_wrapper)``: ``owner.attribute = make_wrapper(original)`` inside the block."""
    undo = []
    try:
        for owner, name, make in replacements:
            own = name in vars(owner)  # an instance/module attribute (restore it) or the class's method (delete ours)
            original = getattr(owner, name)
            setattr(owner, name, make(original))
            undo.append((owner, name, own, original))
        yield
    finally:
        for owner, name, own, original in reversed(undo):
            if own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)


@dataclass(frozen=True)
class StepRecord:
    num_seqs: int
    num_tokens: int  # tokens computed this step (== num_seqs for a pure decode step)
    context_tokens: int  # sum over the sequences of their context after this step (KV read by attention)
    lora_ids: frozenset[int]  # distinct adapters in the step
    num_sampled: int = 0  # sequences that sample a token this step (rows through the LM head)
    scheduled_at: float = 0.0  # time.perf_counter() when the step was scheduled
    # the engine's device_wait_seconds then: its time blocked on sampled tokens so far (the difference to the next
    # step's is the waiting inside this step's interval)
    device_wait_at: float = 0.0

    @property
    def is_decode(self) -> bool:
        return self.num_tokens == self.num_seqs


class ScheduleRecorder:
    """Wraps ``engine.scheduler.schedule``; ``steps`` gets one ``StepRecord`` per non-empty step.

    Costs one pass over the scheduled requests per step (tens of µs at 256 sequences)."""

    def __init__(self, engine):
        self.engine = engine
        self.steps: list[StepRecord] = []
        self._patch = None

    def _wrap(self, schedule: Callable) -> Callable:
        steps, engine = self.steps, self.engine

        def recorded_schedule():
            out = schedule()
            if out.scheduled:
                computed = new = sampled = 0
                for s in out.scheduled:
                    computed += s.request.num_computed_tokens
                    new += s.num_new_tokens
                    sampled += s.num_samples > 0
                steps.append(StepRecord(len(out.scheduled), new, computed + new, frozenset(out.lora_ids), sampled,
                                        time.perf_counter(), getattr(engine, "device_wait_seconds", 0.0)))
            return out

        return recorded_schedule

    def __enter__(self) -> ScheduleRecorder:
        self._patch = patched([(self.engine.scheduler, "schedule", self._wrap)])
        self._patch.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._patch.__exit__(*exc)


def step_time_split(steps: list[StepRecord], end: float, end_wait: float | None = None) -> dict:
    """Wall time between one step's scheduling and the next's (the last step: until ``end``), summed by step kind:
    pure decode steps and steps that compute prompt tokens. With overlapped steps an interval is the host's
    pace, which the device sets once the queue is full, so it is the step's time to within one step.

    ``{kind}_wait_s``: the engine's time blocked on the device's sampled tokens inside those intervals (the
    last one up to ``end_wait``, the engine's total at ``end``). An interval with little waiting ran at the
    host's pace: the device finished before the host asked (host-bound steps)."""
    split = {"decode_steps": 0, "decode_s": 0.0, "prefill_steps": 0, "prefill_s": 0.0,
             "decode_wait_s": 0.0, "prefill_wait_s": 0.0}
    last_wait = steps[-1].device_wait_at if end_wait is None and steps else end_wait
    for step, (nxt, nxt_wait) in zip(steps, [(s.scheduled_at, s.device_wait_at) for s in steps[1:]]
                                     + [(end, last_wait)]):
        kind = "decode" if step.is_decode else "prefill"
        split[f"{kind}_steps"] += 1
        split[f"{kind}_s"] += max(0.0, nxt - step.scheduled_at)
        split[f"{kind}_wait_s"] += max(0.0, nxt_wait - step.device_wait_at)
    return split


def triton_compiled_variants(prefix: str = "loraplex.kernels.") -> dict[str, set[str]] | None:
    """Compiled variants held by the Triton kernels of the modules named ``prefix``* (default: ours, every device):
    ``module.kernel`` -> the cache keys (each one specialization: constexprs, argument types, divisibility). None
    when this Triton keeps them where we do not look."""
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return None
    variants: dict[str, set[str]] = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith(prefix) or module is None:
            continue
        for obj in list(vars(module).values()):
            # a JITFunction itself (whose .fn is the plain Python function), or an autotuner / heuristics wrapper
            # holding one in .fn
            fn = obj if isinstance(obj, JITFunction) else getattr(obj, "fn", None)
            if not isinstance(fn, JITFunction):
                continue
            caches = getattr(fn, "device_caches", None)
            if caches is None:
                return None
            # named where it is defined: a kernel imported into several modules is one kernel
            keys = variants.setdefault(f"{fn.fn.__module__}.{fn.fn.__name__}", set())
            for device, entry in caches.items():
                keys.update(f"{device}:{key}" for key in (entry[0] if isinstance(entry, tuple) else entry))
    return variants


def triton_compiled_kernels(prefix: str = "loraplex.kernels.") -> int:
    """How many variants ``triton_compiled_variants`` finds; -1 when it cannot look. A rise across a timed window
    means kernels were compiled inside it."""
    variants = triton_compiled_variants(prefix)
    return -1 if variants is None else sum(len(keys) for keys in variants.values())


def new_compiled_variants(before: dict[str, set[str]] | None, after: dict[str, set[str]] | None,
                          key_chars: int = 400) -> list[str] | None:
    """The variants in ``after`` and not in ``before`` as "module.kernel: key" (the key cut to ``key_chars``), so a
    report can name what compiled inside its timed window; None where either could not be read."""
    if before is None or after is None:
        return None
    return sorted(f"{kernel}: {key[:key_chars]}" for kernel, keys in after.items()
                  for key in keys - before.get(kernel, set()))


class _CallTimer:
    """Stands in for a callable object whose ``__call__`` is timed (Python looks dunder methods up on the type, so
    the instance itself cannot be patched); every other attribute is read from the object."""

    def __init__(self, obj, timed_call: Callable):
        self._obj = obj
        self._timed_call = timed_call

    def __call__(self, *args, **kwargs):
        return self._timed_call(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._obj, name)


class PhaseTimers:
    """Host wall time of each phase of ``LLMEngine.step()``, per step, exclusive of nested phases.

    Phases (each a wrapped method of the live engine, where the engine has it): ``schedule``
    (``Scheduler.schedule``), ``pin adapters`` (the engine keeps running adapters in their slots), ``prepare
    inputs`` (``StepInputBuilder.prepare``), ``LoRA slots`` (slot assignment / per-step LoRA mapping), ``forward
    launch`` (graph replay or the eager forward, with the host->device input copies), ``sample: logits`` and
    ``sample: sampler`` (host time to launch the LM head and the sampler), ``sample: launch`` (the rest of
    queueing the sampling), ``sample: D2H wait + results`` (waiting for the device to finish the step — the one
    device->host copy — then the tokens as host lists), ``runner: other`` (the runner's step outside those),
    ``update`` (``Scheduler.update_from_output`` without its text), ``detokenize`` (the batched incremental
    detokenizer), ``deltas`` (a ``TokenDelta`` per request); ``other`` is the step's wall time inside none of
    them. With ``annotate`` each phase is also a profiler range ``phase:<name>``, so a trace can tell which
    phase launched a kernel. Methods the engine does not have are skipped, so the timers follow the engine as
    it changes (with overlapped steps the wait is for the step launched by the previous call)."""

    def __init__(self, engine, annotate: bool = False):
        self.engine = engine
        self.annotate = annotate
        self.steps: list[dict[str, float]] = []  # seconds per phase, plus "step" (the whole step)
        self.calls: dict[str, int] = {}  # wrapped calls over all recorded steps
        self._current: dict[str, float] | None = None
        self._stack: list[list] = []  # [name, start_ns, child_ns]

    def _replacements(self) -> list[tuple[object, str, Callable[[Callable], Callable]]]:
        engine = self.engine
        runner = engine.runner
        sampler = runner.step_sampler
        plain = [(engine.scheduler, "schedule", "schedule"), (engine, "_pin_running_adapters", "pin adapters"),
                 (runner, "execute", "runner: other"), (runner, "launch", "runner: other"),
                 (runner.inputs, "prepare", "prepare inputs"), (runner, "_run_eager", "forward launch"),
                 (runner.graphs, "run", "forward launch"), (runner.lora_manager, "assign_slots", "LoRA slots"),
                 (runner.lora_manager, "prepare_step", "LoRA slots"), (sampler, "compute_logits", "sample: logits"),
                 (getattr(sampler, "sampler", None), "sample", "sample: sampler"),
                 (engine.scheduler, "update_from_output", "update"), (engine, "_delta", "deltas"),
                 (sys.modules[type(engine.scheduler).__module__], "append_batch", "detokenize")]
        out = [(owner, attr, self._wrap(phase)) for owner, attr, phase in plain
               if owner is not None and callable(getattr(owner, attr, None))]
        if callable(getattr(sampler, "launch", None)):  # sampling queued now, its result waited for later
            out.append((sampler, "launch", self._wrap("sample: launch", on_result=self._time_result)))
        else:  # one call samples and waits
            out.append((runner, "step_sampler",
                        lambda obj: _CallTimer(obj, self._wrap("sample: D2H wait + results")(obj))))
        return out

    def _time_result(self, pending):
        """The object a sampling launch returns: its ``result()`` (the wait for the tokens) is timed too."""
        if callable(getattr(pending, "result", None)) and hasattr(pending, "__dict__"):
            pending.result = self._wrap("sample: D2H wait + results")(pending.result)
        return pending

    def _wrap(self, phase: str, on_result: Callable | None = None) -> Callable[[Callable], Callable]:
        def make(original: Callable) -> Callable:
            def timed(*args, **kwargs):
                if self._current is None:
                    return original(*args, **kwargs)
                frame = [phase, time.perf_counter_ns(), 0]
                self._stack.append(frame)
                try:
                    if self.annotate:
                        import torch

                        with torch.profiler.record_function("phase:" + phase):
                            value = original(*args, **kwargs)
                    else:
                        value = original(*args, **kwargs)
                finally:
                    self._stack.pop()
                    elapsed = time.perf_counter_ns() - frame[1]
                    self._current[phase] = self._current.get(phase, 0.0) + (elapsed - frame[2]) / 1e9
                    self.calls[phase] = self.calls.get(phase, 0) + 1
                    if self._stack:
                        self._stack[-1][2] += elapsed
                return on_result(value) if on_result else value
            return timed
        return make

    def install(self):
        """A context manager: the wrappers stay in place inside it (they time only inside ``step``)."""
        return patched(self._replacements())

    def step(self):
        """One timed ``engine.step()``; returns its deltas."""
        self._current = {}
        start = time.perf_counter_ns()
        try:
            deltas = self.engine.step()
        finally:
            wall = (time.perf_counter_ns() - start) / 1e9
            record, self._current = self._current, None
        record["other"] = max(0.0, wall - sum(record.values()))
        record["step"] = wall
        self.steps.append(record)
        return deltas
