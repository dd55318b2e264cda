"""Kernel unit tests run Triton on the CPU: the interpreter must be chosen before triton is imported."""

import os

import pytest

os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(autouse=True)
def _triton_interpreter():
    """Triton imported earlier without the interpreter (e.g. by GPU tests in the same process) cannot
    run these CPU tests: fail on a CPU machine (a real defect), skip visibly on a CUDA machine."""
    import torch
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(tl.cdiv, InterpretedFunction):
        return
    msg = "triton was imported before TRITON_INTERPRET=1; run tests/unit/kernels in its own pytest process"
    if torch.cuda.is_available():
        pytest.skip(msg)
    pytest.fail(msg)
