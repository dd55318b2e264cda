"""A one-line Triton kernel around ``round_to_e4m3`` for the tests (kernels must live in files for Triton)."""

import triton
import triton.language as tl

from loraplex.kernels.fp8 import round_to_e4m3


@triton.jit
def round_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    x = tl.load(x_ptr + i, mask=mask, other=0.0)
    tl.store(out_ptr + i, round_to_e4m3(x).to(out_ptr.dtype.element_ty), mask=mask)
