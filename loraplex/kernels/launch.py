"""Launching our Triton kernels with less host work per call (eager steps launch hundreds of them).

``kernel[grid](*args, **kwargs)`` on a ``triton.JITFunction`` binds the arguments to the signature, specializes
each one, builds a cache key from the specializations and the options, looks the compiled kernel up, checks the
globals it used, builds launch metadata, then calls the compiled kernel's launcher. On the H200 a mixed step
(prompt tokens: no CUDA graph) spends most of its host time there (run 11: cProfile of
``bench step-profile --step-prompt-tokens 384``, docs/benchmarks/H200-2026-12-02-run11.md).

``fast_launch`` wraps a ``@triton.jit`` kernel so that ``kernel[grid](...)`` keeps its meaning but, once a call
with the same *specialization key* has compiled, goes straight to the compiled kernel's launcher. Our key is
never coarser than Triton's own, so the kernel it finds is the one Triton would have run:

- a tensor: its dtype and whether its address is 16-byte aligned (Triton's pointer specialization);
- an int: ``== 1``, divisible by 16, and whether it fits in 32 bits (Triton's integer specialization and type);
  also for arguments Triton does not specialize (``do_not_specialize``), which only adds cache entries;
- a float: its type only (Triton passes every float as fp32, never specialized on its value);
- a constexpr parameter, any keyword argument (our kernels take their constexprs by keyword) and anything else
  (bools, None, strings, launch options such as ``num_warps``): the value itself. (Run 11's first version keyed
  keyword ints by their class like the runtime ints, so ``BLOCK_R=16`` and ``BLOCK_R=32`` shared a compiled kernel:
  the GPU tests failed; the CPU test ``test_a_new_specialization_goes_through_triton[constexpr_int]`` covers it.)

The first call of each key runs Triton's own path (compiling if needed) and records the compiled kernel. Any
call Triton's path must handle goes there: a grid that is not a tuple, launch hooks set (profilers such as
proton), the interpreter (``TRITON_INTERPRET=1``: ``triton.jit`` returns no JITFunction then), a Triton whose
launcher has another calling convention (before 3.3), or unless ``LORAPLEX_FAST_LAUNCH=1`` (see ``ENABLED``). Skipped against Triton's
path: the check that the globals a kernel read at compile time still hold the same values (ours are module
constants).
"""

from __future__ import annotations

import inspect
import os

import torch
import triton

try:
    from triton import knobs as _knobs
    from triton.runtime.jit import JITFunction
except ImportError:  # pragma: no cover - Triton before 3.3: another launcher convention
    _knobs = JITFunction = None


def _version_ok() -> bool:
    try:
        major, minor = (int(p) for p in triton.__version__.split(".")[:2])
    except ValueError:  # pragma: no cover - unusual version string
        return False
    return (3, 3) <= (major, minor) < (4, 0)


# Opt-in (LORAPLEX_FAST_LAUNCH=1), experimental: on the H200 (triton 3.6, run 11) the GPU tests failed with the first
# version (keyword constexprs keyed by integer class, see the module doc); the fixed key has run on the CPU only
# (docs/benchmarks/H200-2026-12-02-run11.md). Off, ``fast_launch`` returns the kernel itself and every launch is
# Triton's own.
ENABLED = (os.environ.get("LORAPLEX_FAST_LAUNCH", "0") == "1" and _knobs is not None and _version_ok()
           and os.environ.get("TRITON_INTERPRET") != "1")

_INT32 = (-(1 << 31), (1 << 31) - 1)


def _idle(hook) -> bool:
    """No launch hook to call: None, or (Triton >= 3.5) an empty hook chain."""
    if hook is None:
        return True
    calls = getattr(hook, "calls", None)  # triton.knobs.HookChain
    return isinstance(calls, list) and not calls


def spec_key(value):
    """One argument's part of the cache key (see module doc)."""
    kind = type(value)
    if kind is int:
        return (value == 1, value % 16 == 0, _INT32[0] <= value <= _INT32[1])
    if kind is float:
        return float
    if isinstance(value, torch.Tensor):
        return (value.dtype, value.data_ptr() % 16 == 0)
    return value


class FastLaunchKernel:
    """A ``@triton.jit`` kernel whose ``[grid](...)`` launches skip Triton's per-call binding once compiled."""

    def __init__(self, jit_fn) -> None:
        self.jit_fn = jit_fn
        params = inspect.signature(jit_fn.fn).parameters
        self._names = tuple(params)
        # positions of constexpr parameters: a positional constexpr is keyed by its value (slower key)
        constexpr = [i for i, p in enumerate(jit_fn.params) if p.is_constexpr]
        self._first_constexpr = min(constexpr) if constexpr else len(self._names)
        self._constexpr_pos = frozenset(constexpr)
        self._defaults = {n: p.default for n, p in params.items() if p.default is not inspect.Parameter.empty}
        self._cache: dict = {}
        self._stream_of = None
        self.fast_launches = 0  # launches that went straight to the launcher (tests read it)

    def __getattr__(self, name):  # the JITFunction's attributes (fn, params, cache, ...)
        return getattr(self.jit_fn, name)

    def __getitem__(self, grid):
        if type(grid) is not tuple:
            return self.jit_fn[grid]
        return lambda *args, **kwargs: self._launch(grid, args, kwargs)

    def _launch(self, grid, args, kwargs):
        runtime = _knobs.runtime
        if not (_idle(runtime.launch_enter_hook) and _idle(runtime.launch_exit_hook)):
            return self.jit_fn[grid](*args, **kwargs)
        device = torch.cuda.current_device()
        try:
            if len(args) <= self._first_constexpr:
                positional = tuple(map(spec_key, args))
            else:
                positional = tuple(v if i in self._constexpr_pos else spec_key(v) for i, v in enumerate(args))
            key = (device, positional,
                   tuple([(k, spec_key(v) if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()]))
            hit = self._cache.get(key)
        except TypeError:  # an unhashable argument: Triton's path decides
            return self.jit_fn[grid](*args, **kwargs)
        if hit is None:
            kernel = self.jit_fn[grid](*args, **kwargs)
            if hasattr(kernel, "result"):  # asynchronous compilation hands back a future
                kernel = kernel.result()
            if kernel is not None:
                tail = self._names[len(args):]
                missing = [n for n in tail if n not in kwargs and n not in self._defaults]
                if not missing:
                    self._cache[key] = (kernel, tail)
            return kernel
        kernel, tail = hit
        values = args + tuple(kwargs[n] if n in kwargs else self._defaults[n] for n in tail) if tail else args
        if self._stream_of is None:
            self._stream_of = triton.runtime.driver.active.get_current_stream
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        kernel.run(grid[0], g1, g2, self._stream_of(device), kernel.function, kernel.packed_metadata, None,
                   None, None, *values)
        self.fast_launches += 1
        return kernel


def fast_launch(jit_fn):
    """Decorator, outermost: ``@fast_launch`` above ``@triton.jit``. Returns the kernel itself where the fast path
    cannot apply (the interpreter, ``LORAPLEX_FAST_LAUNCH=0``, another Triton), so nothing changes there."""
    if not (ENABLED and JITFunction is not None and isinstance(jit_fn, JITFunction)):
        return jit_fn
    return FastLaunchKernel(jit_fn)
