"""The fast launch path's cache (loraplex/kernels/launch.py) without a GPU: a JITFunction whose Triton path is
replaced by a recorder, so the test sees which launches went through Triton (binding, compiling) and which went
straight to the compiled kernel's launcher, and with which arguments. The real launches run in tests/gpu (every
kernel of the engine goes through this path there; tests/gpu/test_fast_launch_gpu.py compares it with Triton's)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from loraplex.kernels import launch
from loraplex.kernels.launch import FastLaunchKernel, fast_launch, spec_key


def _kernel(x_ptr, n, stride, scale, FLAG: tl.constexpr, BLOCK: tl.constexpr = 64):
    pass


class _Compiled:
    """Stands in for a CompiledKernel: records launcher calls."""

    def __init__(self):
        self.function, self.packed_metadata, self.calls = "fn", "meta", []

    def run(self, *args):
        self.calls.append(args)


@pytest.fixture
def wrapped(monkeypatch):
    jit = JITFunction(_kernel)
    compiled = _Compiled()
    triton_path = []

    def run(*args, grid, warmup, **kwargs):
        triton_path.append((grid, args, kwargs))
        return compiled

    monkeypatch.setattr(jit, "run", run)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    kernel = FastLaunchKernel(jit)
    kernel._stream_of = lambda device: 1234
    return kernel, compiled, triton_path


def test_second_launch_of_a_key_goes_to_the_launcher_with_all_arguments_in_order(wrapped):
    kernel, compiled, triton_path = wrapped
    x = torch.zeros(64)
    kernel[(4,)](x, 100, 32, 0.5, FLAG=True)
    assert len(triton_path) == 1 and not compiled.calls and kernel.fast_launches == 0
    kernel[(8, 2)](x, 200, 48, 0.25, FLAG=True)  # same classes: n and stride divisible by 16, neither 1
    assert len(triton_path) == 1 and kernel.fast_launches == 1
    (call,) = compiled.calls
    assert call[:9] == (8, 2, 1, 1234, "fn", "meta", None, None, None)
    assert call[9:] == (x, 200, 48, 0.25, True, 64)  # positional, then keyword and default constexprs in order


@pytest.mark.parametrize("change", ["misaligned", "int_one", "not_div16", "int64", "dtype", "constexpr",
                                    "constexpr_int", "option", "option_value"])
def test_a_new_specialization_goes_through_triton(wrapped, change):
    kernel, compiled, triton_path = wrapped
    x = torch.zeros(64)
    base = dict(args=[x, 32, 32, 0.5], kw=dict(FLAG=True, BLOCK=32, num_warps=4))
    kernel[(1,)](*base["args"], **base["kw"])
    kernel[(1,)](*base["args"], **base["kw"])
    assert len(triton_path) == 1 and kernel.fast_launches == 1
    args, kw = list(base["args"]), dict(base["kw"])
    if change == "misaligned":
        args[0] = x[1:]  # 4 bytes past a 16-byte boundary
    elif change == "int_one":
        args[1] = 1
    elif change == "not_div16":
        args[2] = 33
    elif change == "int64":
        args[1] = 1 << 40
    elif change == "dtype":
        args[0] = torch.zeros(64, dtype=torch.float16)
    elif change == "constexpr":
        kw["FLAG"] = False
    elif change == "constexpr_int":  # same integer class (divisible by 16), another compiled kernel
        kw["BLOCK"] = 64
    elif change == "option":
        kw["num_stages"] = 2
    else:
        kw["num_warps"] = 8
    kernel[(1,)](*args, **kw)
    assert len(triton_path) == 2 and kernel.fast_launches == 1
    kernel[(1,)](*args, **kw)  # and that key is cached in turn
    assert len(triton_path) == 2 and kernel.fast_launches == 2


def test_a_positional_constexpr_is_keyed_by_value(wrapped):
    kernel, compiled, triton_path = wrapped
    x = torch.zeros(64)
    kernel[(1,)](x, 32, 32, 0.5, True, 32)
    kernel[(1,)](x, 32, 32, 0.5, True, 32)
    kernel[(1,)](x, 32, 32, 0.5, True, 64)
    assert len(triton_path) == 2 and kernel.fast_launches == 1
    assert compiled.calls[0][9:] == (x, 32, 32, 0.5, True, 32)


def test_floats_are_not_keyed_by_value_and_hooks_force_tritons_path(wrapped, monkeypatch):
    kernel, compiled, triton_path = wrapped
    x = torch.zeros(64)
    kernel[(1,)](x, 32, 32, 0.5, FLAG=True)
    kernel[(1,)](x, 32, 32, 3.0, FLAG=True)
    assert kernel.fast_launches == 1
    monkeypatch.setattr(launch._knobs.runtime, "launch_enter_hook", lambda *a: None)
    kernel[(1,)](x, 32, 32, 3.0, FLAG=True)
    assert len(triton_path) == 2 and kernel.fast_launches == 1
    kernel[lambda meta: (1,)](x, 32, 32, 3.0, FLAG=True)  # a callable grid: Triton's path too
    assert len(triton_path) == 3


def test_spec_key_classes():
    assert spec_key(1) != spec_key(2) != spec_key(16)
    assert spec_key(32) == spec_key(48) and spec_key(3) == spec_key(5)
    assert spec_key(1 << 33) != spec_key(1 << 4)
    assert spec_key(True) is True and spec_key(None) is None and spec_key(0.1) == spec_key(7.0)
    t = torch.zeros(8, dtype=torch.float16)
    assert spec_key(t) == (torch.float16, True) and spec_key(t[1:]) == (torch.float16, False)


def test_interpreter_kernels_are_left_as_they_are():
    # tests run under TRITON_INTERPRET=1 (conftest): triton.jit gives an interpreted function, returned unwrapped
    interpreted = triton.jit(_kernel)
    assert fast_launch(interpreted) is interpreted
