"""The LoRA kernels compile for Hopper (sm_90) on a machine without a GPU: Triton's bundled ptxas builds the
cubin, so a kernel that only works in the interpreter fails here, in CI, before it reaches an H200."""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton

try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError:  # pragma: no cover - very old triton
    GPUTarget = ASTSource = None

INT_PTRS = ("cnt_ptr", "ranks_ptr", "sorted_ids_ptr", "chunk_slots_ptr", "chunk_starts_ptr", "chunk_lens_ptr", "slice_loc_ptr",
            "num_chunks_ptr", "slots_ptr", "sorted_ptr", "seg_ptr", "chunk_tokens_ptr", "chunk_ranks_ptr")
REPO = Path(__file__).resolve().parents[3]


def compile_here(kernel: str, ptr_types: dict[str, str], constexprs: dict, runtime_hints: bool = False,
                 **options) -> dict:
    """AOT-compile ``module.kernel`` (names under loraplex.kernels) for sm_90; run by ``_compile`` in a child."""
    module, name = kernel.split(".")
    fn = triton.runtime.jit.JITFunction(getattr(importlib.import_module(f"loraplex.kernels.{module}"), name).fn)
    # constexpr parameters the caller leaves out take their defaults, as a launch that omits them does
    constexprs = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}, **constexprs}
    attrs = None
    if runtime_hints:
        # what the JIT launcher knows at run time: unit inner strides, 16-divisible pointers, strides and K
        constexprs.update({n: 1 for n in fn.arg_names if n in ("stride_xk", "stride_ak", "stride_bn", "stride_on",
                                                                "stride_yr", "stride_wk")})
    signature = {n: "constexpr" if n in constexprs else ptr_types.get(n, "*i32" if n in INT_PTRS else "i32")
                 for n in fn.arg_names}
    if runtime_hints:
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
                 if n not in constexprs and (signature[n].startswith("*") or n.startswith("stride") or n in ("K", "K_PER_SPLIT"))}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    return {"ptx": compiled.asm["ptx"], "cubin": bool(compiled.asm["cubin"]), "shared": compiled.metadata.shared}


def job(kernel: str, ptr_types: dict[str, str], constexprs: dict, *, runtime_hints: bool = False, **options) -> list:
    """One kernel build for ``_compile_all`` (the arguments of ``compile_here``)."""
    return [kernel, ptr_types, constexprs, runtime_hints, options]


def _compile_all(*jobs: list) -> list[dict]:
    """``compile_here`` for each job, all in one child process without TRITON_INTERPRET (in this interpreter process
    triton's AOT compile fails on a cold cache, the language being bound to the interpreter); one child for many
    builds: each child pays the torch and triton imports once."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); from test_lora_compile import compile_here; "
            "print(json.dumps([compile_here(*a[:4], **a[4]) for a in json.loads(sys.argv[2])]))")
    done = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent), json.dumps(jobs)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _compile(kernel: str, ptr_types: dict[str, str], constexprs: dict, *, runtime_hints: bool = False,
             **options) -> dict:
    return _compile_all(job(kernel, ptr_types, constexprs, runtime_hints=runtime_hints, **options))[0]


@pytest.mark.skipif(ASTSource is None, reason="this triton has no ahead-of-time compile API")
@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA, tests/gpu compiles and runs the kernels for real")
@pytest.mark.parametrize("regime", ["decode", "prefill"])
def test_kernels_compile_for_sm90_in_bf16(regime):
    block_m, block_r, block_k, split_k = (16, 16, 128, 4) if regime == "decode" else (64, 64, 64, 1)
    expand_types = {"y_ptr": "*fp32", "b_ptr": "*bf16", "out_ptr": "*bf16", "scaling_ptr": "*fp32"}
    built = _compile_all(
        job("lora_shrink._lora_shrink_kernel", {"x_ptr": "*bf16", "a_ptr": "*bf16", "y_ptr": "*fp32"},
            dict(SPLIT_K=split_k, BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k,
                 DOT_PRECISION="tf32", USE_PDL=False, CHUNK_TABLES=False), num_warps=4, num_stages=3),
        job("lora_expand._lora_expand_kernel", expand_types,
            dict(SPLIT_K=split_k, BLOCK_M=block_m, BLOCK_N=128, BLOCK_R=64, DOT_PRECISION="tf32", COL_ALIGN=8,
                 USE_PDL=False, PREFETCH_OUT=True, CHUNK_TABLES=False), num_warps=4),
        job("lora_expand._lora_expand_kernel", expand_types,  # write-only
            dict(SPLIT_K=split_k, BLOCK_M=block_m, BLOCK_N=128, BLOCK_R=64, DOT_PRECISION="tf32",
                 COL_ALIGN=8, USE_PDL=False, PREFETCH_OUT=False, CHUNK_TABLES=False, ACCUMULATE=False),
            num_warps=4))
    for compiled in built:
        assert compiled["cubin"] and "mma" in compiled["ptx"]  # tensor-core dots, not scalar loops
        assert compiled["shared"] <= 100 * 1024
        assert "griddepcontrol" not in compiled["ptx"]  # programmatic dependent launch only when asked


@pytest.mark.skipif(ASTSource is None, reason="this triton has no ahead-of-time compile API")
@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA, tests/gpu compiles and runs the kernels for real")
@pytest.mark.parametrize("split_k", [1, 4])
def test_fused_kernel_compiles_for_sm90_in_bf16(split_k):
    """Both fused variants (column split; split-K with the last-arriver ticket) build with tensor-core dots."""
    compiled = _compile("lora_fused._lora_fused_kernel",
                        {"x_ptr": "*bf16", "a_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*bf16", "y_ptr": "*fp32",
                         "scaling_ptr": "*fp32"},
                        dict(SPLIT_K=split_k, BLOCK_M=16, BLOCK_R=16, BLOCK_K=128, BLOCK_N=128,
                             DOT_PRECISION="tf32", COL_ALIGN=8), num_warps=4, num_stages=3)
    assert compiled["cubin"] and "mma" in compiled["ptx"]
    assert ("atom" in compiled["ptx"]) == (split_k > 1)  # the ticket exists only where K is split
    assert compiled["shared"] <= 100 * 1024


@pytest.mark.skipif(ASTSource is None, reason="this triton has no ahead-of-time compile API")
@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA, tests/gpu compiles and runs the kernels for real")
def test_expand_column_hint_gives_pipelined_16_byte_accesses():
    """Without COL_ALIGN the slice offsets (loaded from memory) have unknown alignment: B and out become 2-byte
    scalar accesses and the N loop is not pipelined. With it: cp.async for B, 16-byte out loads and stores."""
    built = _compile_all(*[job("lora_expand._lora_expand_kernel",
                               {"y_ptr": "*fp32", "b_ptr": "*bf16", "out_ptr": "*bf16", "scaling_ptr": "*fp32"},
                               dict(SPLIT_K=8, BLOCK_M=16, BLOCK_N=128, BLOCK_R=16, DOT_PRECISION="tf32",
                                    COL_ALIGN=align, USE_PDL=False, PREFETCH_OUT=False, CHUNK_TABLES=False),
                               runtime_hints=True, num_warps=4, num_stages=3) for align in (1, 8)])
    ptx = {1: built[0]["ptx"], 8: built[1]["ptx"]}
    assert "cp.async" not in ptx[1] and "st.global.b16" in ptx[1]
    assert "cp.async" in ptx[8] and "st.global.v4" in ptx[8] and "st.global.b16" not in ptx[8]


@pytest.mark.skipif(ASTSource is None, reason="this triton has no ahead-of-time compile API")
@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA, tests/gpu compiles and runs the kernels for real")
def test_programmatic_dependent_launch_only_where_asked():
    """The engine's decode path (per-chunk tables, PDL): griddepcontrol.wait in both kernels (before what earlier
    launches wrote) and launch_dependents in the shrink (the expand may start while it runs); off, neither appears
    (test_kernels_compile_for_sm90_in_bf16). The shrink's x and A loads are cp.async-pipelined (with the run-time
    hints: K divisible by 16), the expand's B too, its out accesses 16 bytes wide."""
    shrink_types = {"x_ptr": "*bf16", "a_ptr": "*bf16", "y_ptr": "*fp32"}
    expand_types = {"y_ptr": "*fp32", "b_ptr": "*bf16", "out_ptr": "*bf16", "scaling_ptr": "*fp32"}
    loads_before_wait = {}
    prefetches_asked = (0, 1, 2)  # weight_prefetch off / first / l2 (PDL off: test_kernels_compile_for_sm90_in_bf16)
    built = _compile_all(*[j for prefetch in prefetches_asked for j in (
        job("lora_shrink._lora_shrink_kernel", shrink_types,
            dict(SPLIT_K=16, BLOCK_M=16, BLOCK_R=16, BLOCK_K=128, DOT_PRECISION="tf32", USE_PDL=True,
                 CHUNK_TABLES=True, PREFETCH_A=prefetch),
            runtime_hints=True, num_warps=2, num_stages=3),
        job("lora_expand._lora_expand_kernel", expand_types,
            dict(SPLIT_K=16, BLOCK_M=16, BLOCK_N=128, BLOCK_R=16, DOT_PRECISION="tf32", COL_ALIGN=16,
                 USE_PDL=True, PREFETCH_OUT=True, CHUNK_TABLES=True, PREFETCH_B=prefetch),
            runtime_hints=True, num_warps=4, num_stages=3))])
    for i, prefetch in enumerate(prefetches_asked):
        shrink, expand = built[2 * i]["ptx"], built[2 * i + 1]["ptx"]
        assert "griddepcontrol.wait" in shrink and "griddepcontrol.launch_dependents" in shrink
        assert "griddepcontrol.wait" in expand and "griddepcontrol.launch_dependents" not in expand
        assert "ld.global.b16" not in shrink and "st.global.b16" not in expand and "st.global.v4" in expand
        # the main wait is the last one (program 0 also waits first thing)
        loads_before_wait[prefetch] = [len(re.findall(r"ld\.global", ptx[:ptx.rfind("griddepcontrol.wait")]))
                                       for ptx in (shrink, expand)]
        prefetches = [len(re.findall(r"prefetch\.global\.L2", ptx[:ptx.rfind("griddepcontrol.wait")]))
                      for ptx in (shrink, expand)]
        assert all(prefetches) == (prefetch == 2) and any(prefetches) == (prefetch == 2)
        if prefetch != 1:  # the compiler's pipelining (cp.async) carries the weights' loop
            assert "cp.async" in shrink and "cp.async" in expand
    # "first": the weights' first tile is loaded before the wait, on top of the metadata loads
    assert all(f > o for f, o in zip(loads_before_wait[1], loads_before_wait[0]))


@pytest.mark.skipif(ASTSource is None, reason="this triton has no ahead-of-time compile API")
@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA, tests/gpu compiles and runs the kernels for real")
@pytest.mark.parametrize("pdl", [False, True])
def test_silu_mul_kernel_compiles_with_the_expands_launch_options(pdl):
    """gate|up's delta inside SiLU-and-multiply at the engine's decode options: per-chunk tables, gate and up one tile
    ahead, 16-byte accesses to gate|up and act, B cp.async-pipelined; with PDL a wait before what earlier launches
    wrote and no launch_dependents (the next launch, the down projection's GEMM, is not a dependent launch)."""
    ptx = _compile("lora_silu_mul._lora_silu_mul_kernel",
                   {"gu_ptr": "*bf16", "y_ptr": "*fp32", "b_ptr": "*bf16", "act_ptr": "*bf16", "scaling_ptr": "*fp32",
                    "token_slots_ptr": "*i32"},
                   dict(SPLIT_K=16, BLOCK_M=16, BLOCK_N=256, BLOCK_R=16, BASE_BLOCK_M=16, DOT_PRECISION="tf32",
                        COL_ALIGN=16, USE_PDL=pdl, CHUNK_TABLES=True, PREFETCH=True),
                   runtime_hints=True, num_warps=4, num_stages=3)["ptx"]
    assert ("griddepcontrol.wait" in ptx) == pdl and "griddepcontrol.launch_dependents" not in ptx
    assert "ld.global.b16" not in ptx and "st.global.b16" not in ptx and "st.global.v4" in ptx
    assert len(re.findall(r"mma", ptx)) >= 2


@pytest.mark.skipif(ASTSource is None, reason="this triton has no ahead-of-time compile API")
@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA, tests/gpu compiles and runs the kernels for real")
@pytest.mark.parametrize("tb, sb, cb", [(1024, 1024, 16)])  # the largest tiles the builder uses
def test_metadata_kernel_compiles_for_sm90(tb, sb, cb):
    compiled = _compile("lora_meta._lora_meta_kernel", {}, dict(BLOCK_M=16, TB=tb, SB=sb, CB=cb, UB=16),
                        num_warps=4 if tb <= 256 else 8)
    assert compiled["cubin"] and compiled["shared"] <= 16 * 1024


@pytest.mark.skipif(ASTSource is None, reason="this triton has no ahead-of-time compile API")
@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA, tests/gpu compiles and runs the kernels for real")
@pytest.mark.parametrize("pdl", [False, True])
def test_ticketed_kernel_compiles_for_sm90_with_its_memory_orders(pdl):
    """The one-launch shrink + expand at the engine's decode tiles: tensor-core dots and cp.async-pipelined loops in
    both halves, the shrink's count a release reduction after a CTA barrier, the expand's wait an acquire load, its
    partials read through L2 (.cg); griddepcontrol.wait only with PDL, and no launch_dependents (the next launch may
    be another ticketed kernel, which must not take a ticket before this one's are reset)."""
    compiled = _compile("lora_ticketed._lora_ticketed_kernel",
                        {"x_ptr": "*bf16", "a_ptr": "*bf16", "y_ptr": "*fp32", "b_ptr": "*bf16", "out_ptr": "*bf16",
                         "scaling_ptr": "*fp32"},
                        dict(SPLIT_K=32, BLOCK_M=16, BLOCK_R=16, BLOCK_K=128, BLOCK_N=128, EXPAND_BLOCK_R=16,
                             DOT_PRECISION="tf32", COL_ALIGN=16, USE_PDL=pdl, PREFETCH_OUT=True, CHUNK_TABLES=True),
                        runtime_hints=True, num_warps=4, num_stages=3)
    ptx = compiled["ptx"]
    assert "nanosleep" not in ptx
    assert compiled["cubin"] and compiled["shared"] <= 100 * 1024
    assert len(re.findall(r"mma", ptx)) >= 2 and "cp.async" in ptx
    assert re.search(r"bar\.sync\s+0;\s+(?:\S.*\n\s*)*?@%p\d+ red\.global\.gpu\.release\.add\.u32", ptx)
    assert "ld.global.gpu.acquire.b32" in ptx and "ld.global.cg" in ptx
    assert ("griddepcontrol.wait" in ptx) == pdl and "griddepcontrol.launch_dependents" not in ptx
    assert "ld.global.b16" not in ptx and "st.global.v4" in ptx
