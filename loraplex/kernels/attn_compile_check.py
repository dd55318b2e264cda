"""Compile the attention kernels for Hopper (sm_90) without a GPU: ``python -m loraplex.kernels.attn_compile_check``.

The CPU interpreter runs the kernels' Python, not Triton's compiler, so a kernel can pass every interpreter
test and still fail to compile. This builds each kernel at the engine's configurations through the real
compiler down to a cubin (Triton ships ptxas), with the pointer/stride divisibility Triton infers at
launch, and checks that the K/V loads of the attention loops are software-pipelined (``cp.async``).
Run it in a process where TRITON_INTERPRET is unset. Exit code 0 = all compiled.
"""

from __future__ import annotations

import os
import re
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from loraplex.kernels import attn_decode, attn_prefill, fused_ops, kv_store

HOPPER = GPUTarget("cuda", 90, 32)
BF16_ARGS = {
    "q_ptr": "*bf16", "key_cache_ptr": "*bf16", "value_cache_ptr": "*bf16", "out_ptr": "*bf16",
    "key_ptr": "*bf16", "value_ptr": "*bf16", "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32",
    "query_start_loc_ptr": "*i32", "slot_mapping_ptr": "*i64", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32",
    "qk_scale": "fp32", "qkv_ptr": "*bf16", "cos_ptr": "*bf16", "sin_ptr": "*bf16", "q_out_ptr": "*bf16",
    "slot_ptr": "*i64", "key_scale_ptr": "*fp32", "value_scale_ptr": "*fp32",
}


def compile_kernel(kernel, constexprs: dict, num_warps: int, num_stages: int, args: dict = BF16_ARGS,
                   unaligned: tuple[str, ...] = ()) -> dict:
    """Compile for sm_90; integer/pointer arguments get the divisibility-by-16 Triton infers at launch."""
    kernel = getattr(kernel, "jit_fn", kernel)  # a fast_launch wrapper: its JITFunction
    # constexpr parameters left out take their defaults, as a launch that omits them does
    constexprs = {**{p.name: p.default for p in kernel.params if p.is_constexpr and p.has_default}, **constexprs}
    names = kernel.arg_names
    signature = {n: "constexpr" if n in constexprs else args.get(n, "i32") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
             if signature[n] not in ("constexpr", "fp32") and n not in unaligned}
    source = ASTSource(fn=kernel, signature=signature, attrs=attrs,
                       constexprs={(names.index(k),): v for k, v in constexprs.items()})
    compiled = triton.compile(source, target=HOPPER, options={"num_warps": num_warps, "num_stages": num_stages})
    ptx = compiled.asm["ptx"]
    return {"shared": compiled.metadata.shared, "cp_async": len(re.findall(r"cp\.async", ptx)),
            "cubin_bytes": len(compiled.asm["cubin"])}


def cases() -> list[tuple[str, object, dict, int, int, bool]]:
    """(label, kernel, constexprs, warps, stages, must pipeline) at Llama-3-8B's head shape, GQA 1/4/8."""
    out = []
    for group in (1, 4, 8):
        for splits in (1, 4):
            out.append((f"decode g={group} splits={splits}", attn_decode._decode_split_kernel,
                        {"GROUP": group, "BLOCK_H": max(16, group), "HEAD_DIM": 128, "BLOCK_D": 128,
                         "BLOCK_N": attn_decode.DEFAULT_BLOCK_N, "NUM_SPLITS": splits, "DOT_PRECISION": "tf32"},
                        attn_decode.DEFAULT_NUM_WARPS, attn_decode.DEFAULT_NUM_STAGES, True))
        block_q = max(1, 64 // group)
        out.append((f"prefill g={group}", attn_prefill._prefill_kernel,
                    {"GROUP": group, "GROUP_P2": group, "HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_Q": block_q,
                     "BLOCK_M": block_q * group, "BLOCK_N": 64, "DOT_PRECISION": "tf32"}, 4, 2, True))
    out.append(("decode merge", attn_decode._decode_merge_kernel,
                {"HEAD_DIM": 128, "BLOCK_D": 128, "NUM_SPLITS": 4, "BLOCK_S": 4}, 4, 2, False))
    out.append(("store_kv", kv_store._store_kv_kernel, {"NUM_KV_HEADS": 8, "HEAD_DIM": 128, "BLOCK": 1024},
                4, 2, False))
    return out


FP8_ARGS = {**BF16_ARGS, "key_cache_ptr": "*fp8e4nv", "value_cache_ptr": "*fp8e4nv"}
INT8_ARGS = {**BF16_ARGS, "key_cache_ptr": "*i8", "value_cache_ptr": "*i8"}


def fp8_cases() -> list[tuple[str, object, dict, int, int, bool]]:
    """The kernels that touch the cache, over a float8 e4m3 cache (``kv_cache_dtype="fp8"``) and an INT8 one with
    row scales (``"int8"``), GQA 4."""
    out = []
    for label, kernel, constexprs, warps, stages, must_pipeline in cases():
        if label in ("decode g=4 splits=1", "decode g=4 splits=4", "prefill g=4"):
            out.append((f"{label} fp8 KV", kernel, constexprs, warps, stages, must_pipeline))
        if label == "decode g=4 splits=1":  # the dots in fp16 (f16_dots)
            out.append((f"{label} fp8 KV f16 dots", kernel, {**constexprs, "F16_DOTS": True}, warps, stages,
                        must_pipeline))
        elif label == "store_kv":
            out.append(("store_kv fp8 KV", kernel, {**constexprs, "FP8": True}, warps, stages, False))
    for label, kernel, constexprs, warps, stages, must_pipeline in cases():  # INT8 cache with row scales
        if label in ("decode g=4 splits=1", "decode g=4 splits=4", "prefill g=4"):
            out.append((f"{label} int8 KV", kernel, {**constexprs, "KV_INT8": True}, warps, stages, must_pipeline))
    out.append(("store_kv int8 KV", kv_store._store_kv_int8_kernel,
                {"NUM_KV_HEADS": 8, "HEAD_DIM": 128, "BLOCK_H": 8, "BLOCK_D": 128}, 4, 2, False))
    for fp8 in (False, True):  # the fused RoPE + KV store of the engine's layers (kernels/fused_ops.py)
        out.append((f"rope_store{' fp8 KV' if fp8 else ''}", fused_ops._rope_store_kernel,
                    {"NUM_HEADS": 32, "NUM_KV_HEADS": 8, "HEAD_DIM": 128, "Q_BLOCK": 4096, "KV_BLOCK": 1024,
                     "FP8": fp8}, 8, 2, False))
    return out


def main() -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: the interpreter replaces the compiler", file=sys.stderr)
        return 2
    failed = 0
    runs = [(case, BF16_ARGS) for case in cases()]
    runs += [(case, FP8_ARGS if "fp8" in case[0] else INT8_ARGS if "int8" in case[0] else BF16_ARGS)
             for case in fp8_cases()]
    for (label, kernel, constexprs, warps, stages, must_pipeline), args in runs:
        unaligned = ("num_seqs",) if kernel is attn_prefill._prefill_kernel else ()
        try:
            info = compile_kernel(kernel, constexprs, warps, stages, args=args, unaligned=unaligned)
        except Exception as exc:
            print(f"FAIL {label}: {type(exc).__name__}: {exc}")
            failed += 1
            continue
        ok = info["cp_async"] > 0 or not must_pipeline
        failed += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {label}: shared {info['shared']} B, cp.async {info['cp_async']}, "
              f"cubin {info['cubin_bytes']} B{'' if ok else ' (K/V loads not pipelined)'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
