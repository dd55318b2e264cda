"""The LoRA kernels compile for Hopper (sm_90) on a machine without a GPU: Triton's bundled ptxas builds the
cubin, so a kernel that only works in the interpreter fails here, in CI, before it reaches an H200."""

from __future__ import annotations

import pytest
import torch
import triton

from loraplex.kernels import lora_expand, lora_fused, lora_shrink

try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError:  # pragma: no cover - very old triton
    GPUTarget = ASTSource = None

INT_PTRS = ("cnt_ptr", "ranks_ptr", "sorted_ids_ptr", "chunk_slots_ptr", "chunk_starts_ptr", "chunk_lens_ptr", "slice_loc_ptr")


def _compile(kernel, ptr_types: dict[str, str], constexprs: dict, *, runtime_hints: bool = False, **options):
    # the test process runs kernels in the interpreter: compile the plain function instead
    fn = triton.runtime.jit.JITFunction(getattr(kernel, "fn", kernel))
    constexprs = dict(constexprs)
    attrs = None
    if runtime_hints:
        # what the JIT launcher knows at run time: unit inner strides, 16-divisible pointers and strides
        constexprs.update({n: 1 for n in fn.arg_names if n in ("stride_xk", "stride_ak", "stride_bn", "stride_on",
                                                                "stride_yr")})
    signature = {name: "constexpr" if name in constexprs else ptr_types.get(name, "*i32" if name in INT_PTRS
                                                                             else "i32")
                 for name in fn.arg_names}
    if runtime_hints:
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
                 if n not in constexprs and (signature[n].startswith("*") or n.startswith("stride"))}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


@pytest.mark.skipif(ASTSource is None, reason="this triton has no ahead-of-time compile API")
@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA, tests/gpu compiles and runs the kernels for real")
@pytest.mark.parametrize("regime", ["decode", "prefill"])
def test_kernels_compile_for_sm90_in_bf16(regime):
    block_m, block_r, block_k, split_k = (16, 16, 128, 4) if regime == "decode" else (64, 64, 64, 1)
    shrink = _compile(lora_shrink._lora_shrink_kernel, {"x_ptr": "*bf16", "a_ptr": "*bf16", "y_ptr": "*fp32"},
                      dict(SPLIT_K=split_k, BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k,
                           DOT_PRECISION="tf32"), num_warps=4, num_stages=3)
    expand = _compile(lora_expand._lora_expand_kernel,
                      {"y_ptr": "*fp32", "b_ptr": "*bf16", "out_ptr": "*bf16", "scaling_ptr": "*fp32"},
                      dict(SPLIT_K=split_k, BLOCK_M=block_m, BLOCK_N=128, BLOCK_R=64, DOT_PRECISION="tf32", COL_ALIGN=8),
                      num_warps=4)
    for compiled in (shrink, expand):
        assert compiled.asm["cubin"] and "mma" in compiled.asm["ptx"]  # tensor-core dots, not scalar loops
        assert compiled.metadata.shared <= 100 * 1024


@pytest.mark.skipif(ASTSource is None, reason="this triton has no ahead-of-time compile API")
@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA, tests/gpu compiles and runs the kernels for real")
@pytest.mark.parametrize("split_k", [1, 4])
def test_fused_kernel_compiles_for_sm90_in_bf16(split_k):
    """Both fused variants (column split; split-K with the last-arriver ticket) build with tensor-core dots."""
    compiled = _compile(lora_fused._lora_fused_kernel,
                        {"x_ptr": "*bf16", "a_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*bf16", "y_ptr": "*fp32",
                         "scaling_ptr": "*fp32"},
                        dict(SPLIT_K=split_k, BLOCK_M=16, BLOCK_R=16, BLOCK_K=128, BLOCK_N=128,
                             DOT_PRECISION="tf32"), num_warps=4, num_stages=3)
    assert compiled.asm["cubin"] and "mma" in compiled.asm["ptx"]
    assert ("atom" in compiled.asm["ptx"]) == (split_k > 1)  # the ticket exists only where K is split
    assert compiled.metadata.shared <= 100 * 1024


@pytest.mark.skipif(ASTSource is None, reason="this triton has no ahead-of-time compile API")
@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA, tests/gpu compiles and runs the kernels for real")
def test_expand_column_hint_gives_pipelined_16_byte_accesses():
    """Without COL_ALIGN the slice offsets (loaded from memory) have unknown alignment: B and out become 2-byte
    scalar accesses and the N loop is not pipelined. With it: cp.async for B, 16-byte out loads and stores."""
    ptx = {}
    for align in (1, 8):
        compiled = _compile(lora_expand._lora_expand_kernel,
                            {"y_ptr": "*fp32", "b_ptr": "*bf16", "out_ptr": "*bf16", "scaling_ptr": "*fp32"},
                            dict(SPLIT_K=8, BLOCK_M=16, BLOCK_N=128, BLOCK_R=16, DOT_PRECISION="tf32",
                                 COL_ALIGN=align), runtime_hints=True, num_warps=4, num_stages=3)
        ptx[align] = compiled.asm["ptx"]
    assert "cp.async" not in ptx[1] and "st.global.b16" in ptx[1]
    assert "cp.async" in ptx[8] and "st.global.v4" in ptx[8] and "st.global.b16" not in ptx[8]
