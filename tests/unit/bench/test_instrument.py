"""Bench instrumentation on a real (tiny, CPU) engine: what each step held, the time of each phase of a step,
and the step profile — and the engine's own methods back in place afterwards."""

from __future__ import annotations

from argparse import Namespace

import pytest
import torch

from loraplex.bench.instrument import PhaseTimers
from loraplex.bench.llama8b import write_adapter_pool
from loraplex.bench.offline import adapter_rank_of, make_llm, run_generate
from loraplex.bench.offline_run import prepare_model
from loraplex.bench.roofline import ModelShape, step_bytes, workload_floor
from loraplex.bench.step_profile import profile_decode_steps
from loraplex.bench.workload import make_requests

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    work = tmp_path_factory.mktemp("bench-instrument")
    model_dir = prepare_model(Namespace(model=None, smoke=True, work_dir=str(work), layers=2), CPU)
    adapters = write_adapter_pool(model_dir, 3, 8, CPU)
    llm = make_llm(model_dir, "cpu", "float32", max_loras=4, max_lora_rank=8, max_num_seqs=8)
    import json

    shape = ModelShape.from_hf(json.loads((model_dir / "config.json").read_text()))
    return llm, adapters, shape


def _engine_methods_untouched(engine) -> bool:
    runner = engine.runner
    return ("schedule" not in vars(engine.scheduler) and "update_from_output" not in vars(engine.scheduler)
            and "_delta" not in vars(engine) and "prepare" not in vars(runner.inputs)
            and type(runner.step_sampler).__name__ == "StepSampler" and "launch" not in vars(runner.step_sampler)
            and "launch" not in vars(runner) and "execute" not in vars(runner))


def test_schedule_recorder_sees_each_step_of_a_run(setup):
    llm, adapters, shape = setup
    requests = make_requests(6, 12, 4, "distinct", shape.vocab_size, seed=5)
    steps = []
    row = run_generate(llm, requests, adapters, steps)
    assert row["output_tokens"] == 24
    assert _engine_methods_untouched(llm.engine)
    # the first step holds only prompts (nothing computed before it): context = tokens = 12 per sequence
    assert not steps[0].is_decode and steps[0].context_tokens == steps[0].num_tokens == 12 * steps[0].num_seqs
    assert steps[0].num_sampled == steps[0].num_seqs  # whole prompts: each sequence samples its first token
    assert sum(s.num_tokens for s in steps) == 6 * 12 + 6 * 3  # each prompt once, then 3 decoded tokens each
    decode = [s for s in steps if s.is_decode]
    assert decode and all(s.context_tokens >= 13 * s.num_seqs and s.num_sampled == s.num_seqs for s in decode)
    assert all(len(s.lora_ids) <= 4 for s in steps)  # max_loras
    assert {a for s in steps for a in s.lora_ids} == {r.adapter + 1 for r in requests}

    floor = workload_floor(steps, shape, adapter_rank_of(adapters), 4, bandwidth=1e9)
    expect = sum(step_bytes(shape, s.num_tokens, s.context_tokens, [8] * len(s.lora_ids), 4).total for s in steps)
    assert floor["total_bytes"] == expect and floor["floor_s"] == pytest.approx(expect / 1e9)
    assert floor["lora_bytes"] == sum(len(s.lora_ids) for s in steps) * 8 * shape.lora_params_per_rank() * 4
    assert floor["mean_decode_adapters"] == pytest.approx(sum(len(s.lora_ids) for s in decode) / len(decode))

    # the run's wall time split by step kind: every step counted once, the parts add up to the run (less the
    # time before the first step was scheduled)
    d = row["diagnostics"]
    assert d["decode_steps"] == len(decode) and d["prefill_steps"] == len(steps) - len(decode)
    assert 0 < d["decode_s"] + d["prefill_s"] <= row["elapsed_s"]
    assert all(a.scheduled_at <= b.scheduled_at for a, b in zip(steps, steps[1:]))
    assert d["triton_compiles"] == 0  # the CPU path runs the torch twins: nothing compiled (GPU: tests/gpu)
    # engine counters over the run: 6 distinct adapters, 4 slots, each adapter file read once or reused
    eng = d["engine"]
    assert eng["num_steps"] >= len(steps) and eng["lora_slot_loads"] >= 6
    assert eng["lora_host_loads"] + eng["lora_host_reuses"] >= 6 and eng["num_preemptions"] >= 0
    # the host's speed right after the run, shown in the report's time-split table
    assert d["host_probe_ms"] > 0 and (d["load_1m"] is None or d["load_1m"] >= 0)
    from loraplex.bench.sections import time_split_table

    split = time_split_table([{**row, "popularity": "distinct"}])
    assert "| host probe ms | load 1m |" in split and f"{d['host_probe_ms']:.2f}" in split
    # the engine's waits for the device's tokens, split like the wall time: parts of it, by step kind
    assert 0 <= d["decode_wait_s"] <= d["decode_s"] and 0 <= d["prefill_wait_s"] <= d["prefill_s"]
    assert "| ms / decode step | waiting ms / decode step |" in split
    assert "| ms / such step | waiting ms / such step |" in split


def test_phase_timers_account_for_the_whole_step(setup):
    llm, adapters, shape = setup
    requests = make_requests(3, 10, 3, "distinct", shape.vocab_size, seed=6)
    engine = llm.engine
    from loraplex import SamplingParams
    from loraplex.bench.offline import lora_requests

    for i, (r, lora) in enumerate(zip(requests, lora_requests(requests, adapters))):
        engine.add_request(f"phase-{i}", r.prompt_token_ids, SamplingParams(max_tokens=3, ignore_eos=True),
                           lora_request=lora)
    timers = PhaseTimers(engine)
    with timers.install():
        while engine.has_unfinished_requests():
            timers.step()
    assert _engine_methods_untouched(engine)
    assert len(timers.steps) >= 3  # a prefill, then two decode steps (more if admission was spread out)
    for record in timers.steps:
        phases = {k: v for k, v in record.items() if k != "step"}
        assert sum(phases.values()) == pytest.approx(record["step"], rel=1e-6)
        for name in ("schedule", "prepare inputs", "forward launch", "sample: logits", "update", "deltas"):
            assert record[name] > 0, name
    assert timers.calls["deltas"] == 3 * 3  # one per token
    assert timers.calls["schedule"] == len(timers.steps)
    assert timers.calls["LoRA slots"] >= 3


def test_profile_decode_steps_on_the_cpu(setup):
    llm, adapters, shape = setup
    run = profile_decode_steps(llm, batch=3, context=12, num_adapters=2, adapter_dirs=adapters, steps=3,
                               profile_steps=2, vocab_size=shape.vocab_size)
    assert _engine_methods_untouched(llm.engine) and not llm.engine.has_unfinished_requests()
    assert run["steps_timed"] == 3 and run["steps_profiled"] == 2
    phases = {p["phase"]: p for p in run["phases"]}
    assert phases["deltas"]["calls_per_step"] == 3  # one delta per sequence: the whole batch decoded each step
    assert phases["step"]["mean_us"] == pytest.approx(run["step_mean_s"] * 1e6)
    assert sum(p["mean_us"] for name, p in phases.items() if name != "step") == pytest.approx(
        phases["step"]["mean_us"], rel=1e-6)
    trace = run["trace"]
    assert trace["num_steps"] == 2 and not trace["has_gpu_activity"]  # CPU: host operators only
    assert trace["host_ops"]["ops_per_step"] > 0
    assert run["unprofiled_step_minus_gpu_busy_us"] is None


def _plain_kernel_body(x_ptr):  # the Python function behind the JITFunction below (never compiled here)
    pass


def test_compile_counter_finds_plain_jit_functions(monkeypatch):
    """A JITFunction's own .fn is the plain Python function: the counter must take the object itself (it used to
    look only through .fn, so it found none of our kernels and always said 0 compiles)."""
    import sys
    import types

    from triton.runtime.jit import JITFunction

    from loraplex.bench.instrument import triton_compiled_kernels

    kernel = JITFunction(_plain_kernel_body)
    module = types.ModuleType("loraplex_probe_kernels.k")
    module.kernel = kernel
    monkeypatch.setitem(sys.modules, module.__name__, module)
    assert triton_compiled_kernels("loraplex_probe_kernels.") == 0
    kernel.device_caches[0] = ({"variant-a": object(), "variant-b": object()}, None, None, None)
    assert triton_compiled_kernels("loraplex_probe_kernels.") == 2


def test_time_split_attributes_each_interval_and_its_waiting_to_the_step_scheduled_at_its_start():
    from loraplex.bench.instrument import StepRecord, step_time_split

    steps = [StepRecord(4, 400, 400, frozenset(), scheduled_at=0.0, device_wait_at=0.0),  # prompt step
             StepRecord(4, 4, 404, frozenset(), scheduled_at=0.5, device_wait_at=0.1),  # decode: 0.2 s, waited 0.15
             StepRecord(4, 4, 408, frozenset(), scheduled_at=0.7, device_wait_at=0.25)]  # decode: to the end, 0.05
    d = step_time_split(steps, end=1.0, end_wait=0.3)
    assert (d["prefill_steps"], d["decode_steps"]) == (1, 2)
    assert d["prefill_s"] == pytest.approx(0.5) and d["prefill_wait_s"] == pytest.approx(0.1)
    assert d["decode_s"] == pytest.approx(0.5) and d["decode_wait_s"] == pytest.approx(0.2)


def test_new_compiled_variants_names_the_kernel_and_key_compiled_between_two_looks(monkeypatch):
    """The timed window's compiles are named (kernel where it is defined, and its cache key), so a report shows
    which kernel its warm-up missed; a kernel imported into a second module is one kernel, not two."""
    import sys
    import types

    from triton.runtime.jit import JITFunction

    from loraplex.bench.instrument import (
        new_compiled_variants,
        triton_compiled_kernels,
        triton_compiled_variants,
    )
    from loraplex.bench.sections import compiled_note

    kernel = JITFunction(_plain_kernel_body)
    home = types.ModuleType("loraplex_probe_kernels.home")
    home.kernel = kernel
    other = types.ModuleType("loraplex_probe_kernels.other")
    other.imported = kernel
    monkeypatch.setitem(sys.modules, home.__name__, home)
    monkeypatch.setitem(sys.modules, other.__name__, other)
    kernel.device_caches[0] = ({"key-a": object()}, None, None, None)
    before = triton_compiled_variants("loraplex_probe_kernels.")
    assert triton_compiled_kernels("loraplex_probe_kernels.") == 1
    kernel.device_caches[0][0]["key-b" + "x" * 50] = object()
    after = triton_compiled_variants("loraplex_probe_kernels.")
    name = f"{_plain_kernel_body.__module__}._plain_kernel_body"
    assert new_compiled_variants(before, after, key_chars=8) == [f"{name}: 0:key-bx"]  # the key with its device, cut to 8
    assert new_compiled_variants(after, after) == []
    assert new_compiled_variants(None, after) is None
    note = compiled_note([{"popularity": "base", "diagnostics": {"triton_compiled": new_compiled_variants(before, after)}},
                          {"popularity": "zipf", "diagnostics": {"triton_compiled": []}}])
    assert "base: _plain_kernel_body." in note and "zipf" not in note and "timed again" not in note
    assert compiled_note([{"popularity": "zipf", "diagnostics": {"triton_compiled": []}}]) == ""
    again = compiled_note([{"popularity": "zipf", "round": 2, "diagnostics": {"triton_compiled": []},
                            "discarded_run": {"elapsed_s": 14.5, "triton_compiled": [f"{name}: 0:k"]}}])
    assert "timed again" in again and "zipf (2) (14.50 s, compiled _plain_kernel_body)" in again


def test_a_timed_run_with_a_compile_inside_is_run_again_and_the_first_kept_aside(setup, monkeypatch):
    """A Triton compile inside a timed window (a variant the warm-up missed: seconds on the GPU) makes that run no
    measure of the engine: ``run_popularities`` runs the same workload again (new prompt tokens) and keeps the first
    as discarded_run. The CPU runs no Triton kernel, so the first window's compile is stood in for by the variants
    read after it."""
    import loraplex.bench.offline as offline
    from loraplex.bench.offline import run_popularities

    llm, adapters, shape = setup
    looks = []

    def variants(prefix="loraplex.kernels."):
        looks.append(prefix)
        # looks 1-2 frame the first timed window, 3-4 the second: one new variant inside the first only
        return {"k.kernel": {"0:a"} | ({"0:b"} if len(looks) >= 2 else set())}

    monkeypatch.setattr(offline, "triton_compiled_variants", variants)

    def floor(steps):
        return workload_floor(steps, shape, adapter_rank_of(adapters), 4, bandwidth=1e9)

    # 40-token prompts: two full KV blocks each, which the prefix cache would serve to a second run of the same ones
    rows = run_popularities(llm, ["base"], 4, 40, 3, "fixed", shape.vocab_size, adapters, seed=3, floor=floor)
    assert len(looks) == 4 and len(rows) == 1
    row = rows[0]
    assert row["diagnostics"]["triton_compiles"] == 0 and row["output_tokens"] == 12
    assert row["discarded_run"]["triton_compiled"] == ["k.kernel: 0:b"] and row["discarded_run"]["elapsed_s"] > 0
    # the second run is the same workload on new prompt tokens: nothing of it comes from the first run's prefix cache
    assert row["diagnostics"]["engine"]["prefix_cache_hit_tokens"] == 0 and row["prompt_tokens"] == 160
    # without a compile, one run
    looks.clear()
    monkeypatch.setattr(offline, "triton_compiled_variants", lambda prefix="": {"k.kernel": {"0:a"}})
    rows = run_popularities(llm, ["base"], 4, 8, 3, "fixed", shape.vocab_size, adapters, seed=3, floor=floor)
    assert "discarded_run" not in rows[0]
