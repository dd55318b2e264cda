"""Step profile trace summary: GPU busy/idle per step, kernel categories, launches, on a hand-built Chrome trace
in torch.profiler's layout (CPU ranges, runtime calls and GPU activities linked by correlation id)."""

from __future__ import annotations

import pytest

from loraplex.bench.trace_summary import classify, summarize_trace


def _range(name, ts, dur):
    return {"ph": "X", "cat": "user_annotation", "name": name, "ts": ts, "dur": dur}


def _call(name, ts, corr, cat="cuda_runtime"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": 2, "args": {"correlation": corr}}


def _gpu(name, ts, dur, corr, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}


def _trace():
    events = [
        # step 0: [1000, 1100) — a graph replay with three kernels (two overlap), the logits GEMM and argmax
        _range("loraplex_step:0", 1000, 100),
        _range("phase:forward launch", 1005, 10), _call("cudaGraphLaunch", 1008, 1),
        _gpu("sm90_xmma_gemm_bf16bf16_bf16f32", 1015, 20, 1),
        _gpu("_lora_shrink_kernel", 1030, 10, 1),  # overlaps the GEMM by 5 µs
        _gpu("_decode_split_kernel", 1045, 10, 1),
        _range("phase:sample: logits", 1020, 5), _call("cuLaunchKernel", 1021, 2, cat="cuda_driver"),
        _gpu("nvjet_tst_64x8_64x16", 1060, 10, 2),
        _range("phase:sample: sampler", 1026, 4), _call("cudaLaunchKernel", 1027, 3),
        _gpu("reduce_kernel<ArgMaxOps>", 1072, 3, 3),
        _call("cudaMemcpyAsync", 1031, 4), _gpu("Memcpy DtoH (Device -> Pinned)", 1076, 2, 4, cat="gpu_memcpy"),
        # step 1: [2000, 2050) — one KV-store kernel launched outside any phase, running past the step's end,
        # and a kernel of step 0 still running when step 1 begins (overlapped steps)
        _range("loraplex_step:1", 2000, 50),
        _call("cudaLaunchKernel", 2001, 5), _gpu("_rope_store_kernel", 2040, 20, 5),
        _call("cudaLaunchKernel", 1090, 7), _gpu("_silu_mul_kernel", 1995, 10, 7),
        # between the steps: a kernel launched by nothing we profile
        _call("cudaLaunchKernel", 1500, 6), _gpu("vectorized_elementwise_kernel", 1501, 4, 6),
    ]
    return {"traceEvents": events}


def test_busy_idle_launches_and_categories_per_step():
    s = summarize_trace(_trace())
    assert s["num_steps"] == 2 and s["has_gpu_activity"]
    step0, step1 = s["per_step"]
    # step 0 busy: GEMM 1015-1035 ∪ shrink 1030-1040 = 25, + 10 + 10 + 3 + 2 = 50 µs of its 100
    assert step0["gpu_busy_us"] == pytest.approx(50)
    assert step0["gpu_idle_us"] == pytest.approx(50)
    # the memcpy is an activity, not a kernel; the SiLU kernel was launched in step 0 and ran in step 1
    assert step0["kernels"] == 6 and step0["launch_calls"] == 5
    # step 1: the parts inside the step count as busy, whichever step launched them: 5 + 10 of 50 µs
    assert step1["gpu_busy_us"] == pytest.approx(15) and step1["gpu_idle_us"] == pytest.approx(35)
    assert s["kernels_per_step"] == 3.5 and s["launch_calls_per_step"] == 3
    cats = {c["category"]: c for c in s["categories"]}
    assert cats["GEMM"]["gpu_us_per_step"] == pytest.approx((20 + 10) / 2)  # the LM head counts as GEMM
    assert cats["LoRA shrink/expand"]["gpu_us_per_step"] == pytest.approx(5)
    assert cats["attention"]["activities_per_step"] == 0.5
    assert cats["sampling"]["gpu_us_per_step"] == pytest.approx(1.5)  # argmax, launched in the sampler phase
    assert cats["KV store (+rope)"]["gpu_us_per_step"] == pytest.approx(10)  # whole kernel time, 20 µs / 2 steps
    assert cats["memcpy/memset"]["gpu_us_per_step"] == pytest.approx(1)
    assert cats["elementwise/norm/rope"]["gpu_us_per_step"] == 5  # SiLU; not the one launched between steps
    assert sum(c["share_of_gpu_time"] for c in s["categories"]) == pytest.approx(1)
    phases = {p["phase"]: p["gpu_us_per_step"] for p in s["by_launch_phase"]}
    assert phases["forward launch"] == pytest.approx(20) and phases["(no phase)"] == pytest.approx(16)
    assert s["top_kernels"][0]["name"] == "sm90_xmma_gemm_bf16bf16_bf16f32"


def test_cpu_only_trace_counts_host_operators():
    trace = {"traceEvents": [
        _range("loraplex_step:0", 0, 100),
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 10, "dur": 30},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 50, "dur": 20},
        {"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 80, "dur": 5},
        {"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 150, "dur": 5},  # after the step
    ]}
    s = summarize_trace(trace)
    assert not s["has_gpu_activity"] and s["kernels_per_step"] == 0
    assert s["host_ops"]["ops_per_step"] == 3
    assert s["host_ops"]["top_ops"][0] == {"name": "aten::mm", "host_us_per_step": 50.0, "calls_per_step": 2.0}


def test_a_trace_without_steps_is_an_error():
    with pytest.raises(ValueError, match="loraplex_step"):
        summarize_trace({"traceEvents": [_range("something", 0, 1)]})


@pytest.mark.parametrize("name,phase,category", [
    ("_lora_expand_kernel", "phase:forward launch", "LoRA shrink/expand"),
    ("_lora_fused_kernel", None, "LoRA shrink/expand"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "phase:forward launch", "GEMM"),
    ("nvjet_tst_128x64_64x8_2x1_v_bz_TNT", "phase:sample: logits", "GEMM"),
    ("_decode_merge_kernel", "phase:forward launch", "attention"),
    ("_prefill_kernel", None, "attention"),
    ("_store_kv_kernel", None, "KV store (+rope)"),
    ("_rms_norm_kernel", "phase:forward launch", "elementwise/norm/rope"),
    ("_silu_mul_kernel", "phase:forward launch", "elementwise/norm/rope"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward", "phase:sample: sampler", "sampling"),
    ("void at::native::reduce_kernel<512, 1, ArgMaxOps>", None, "sampling"),
    # a sort inside the forward (LoRA metadata) is not sampling
    ("DeviceRadixSortOnesweepKernel", "phase:forward launch", "other"),
])
def test_classify_kernel_names(name, phase, category):
    assert classify(name, "kernel", phase) == category
