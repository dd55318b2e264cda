"""Stand-in kernels for ``bench.launch_floor``: what a launch of our LoRA kernels costs before it moves any bytes.

``empty_kernel`` returns at once (with PDL it lets the next launch start, and its first program waits for the previous
launch, as ours do). ``chain_kernel`` makes the dependent loads each of our decode programs makes before its first
multiply: the chunk count, the chunk's slot from a table, the weights at that slot, then (after the PDL wait) the
activations; it stores one row sum per token of its tile (twin: ``bench.launch_floor.chain_reference``).
"""

from __future__ import annotations

import triton
import triton.language as tl

try:  # grid dependency control (programmatic dependent launch); triton >= 3.4
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older triton: run them with USE_PDL=False
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def empty_kernel(out_ptr, USE_PDL: tl.constexpr):
    if USE_PDL:
        gdc_launch_dependents()
        if (tl.program_id(0) == 0) & (tl.program_id(1) == 0) & (tl.program_id(2) == 0):
            gdc_wait()


@triton.jit
def chain_kernel(num_ptr, table_ptr, w_ptr, x_ptr, out_ptr, w_base, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                 USE_PDL: tl.constexpr):
    lin = tl.program_id(0) + tl.num_programs(0) * (tl.program_id(1) + tl.num_programs(1) * tl.program_id(2))
    if USE_PDL:
        gdc_launch_dependents()
        if lin == 0:
            gdc_wait()
    n = tl.load(num_ptr)  # 1: the chunk count
    if lin >= n:
        return
    row = tl.load(table_ptr + lin)  # 2: the chunk's slot (here: a row of w, a fresh one per launch and program)
    offs_k = tl.arange(0, BLOCK_K)
    w = tl.load(w_ptr + (w_base + row).to(tl.int64) * BLOCK_K + offs_k).to(tl.float32)  # 3: the weights
    if USE_PDL:
        gdc_wait()
    offs_m = tl.arange(0, BLOCK_M)
    x = tl.load(x_ptr + offs_m[:, None] * BLOCK_K + offs_k[None, :]).to(tl.float32)  # 3': the activations
    tl.store(out_ptr + lin.to(tl.int64) * BLOCK_M + offs_m, tl.sum(x * w[None, :], axis=1))
