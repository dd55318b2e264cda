"""Roofline arithmetic on the Llama-3-8B shape (the figures KERNELS.md derives by hand)."""

from __future__ import annotations

import pytest

from loraplex.bench.llama8b import RandomModelSpec, hf_config
from loraplex.bench.roofline import (
    ModelShape,
    decode_step_bytes,
    roofline,
    step_bytes,
    step_flops,
    workload_floor,
)

SHAPE = ModelShape.from_hf(hf_config(RandomModelSpec()))


def test_llama3_8b_lora_and_kv_sizes():
    assert SHAPE.lora_params_per_rank() == 32 * 81_920
    assert SHAPE.lora_params_per_rank() * 16 * 2 == pytest.approx(84e6, rel=0.01)  # one rank-16 adapter: 84 MB
    assert SHAPE.kv_bytes_per_token(2) == 128 * 1024  # 128 KiB per token in bf16


def test_decode_step_bytes_batch_64_distinct_adapters():
    step = decode_step_bytes(SHAPE, [1024] * 64, [16] * 64)
    assert step.weights == pytest.approx(15.0e9, rel=0.01)  # ~7.5 B parameters read per step (not the embedding)
    assert step.lora == pytest.approx(5.37e9, rel=0.01)  # +34% over the base weights
    assert step.kv == 64 * 1024 * 128 * 1024
    base = decode_step_bytes(SHAPE, [1024] * 64, [])
    assert base.lora == 0 and base.total == step.total - step.lora


def test_int8_weights_halve_the_projection_bytes():
    bf16 = decode_step_bytes(SHAPE, [1024] * 64, [])
    int8 = decode_step_bytes(SHAPE, [1024] * 64, [], weight_quant="int8")
    proj = SHAPE.linear_params()  # 6.98e9 projection weights
    assert proj == pytest.approx(6.98e9, rel=0.01)
    rows = 32 * (4096 + 1024 + 1024 + 4096 + 14336 + 14336 + 4096)
    assert int8.weights == bf16.weights - proj + 4 * rows  # 1 byte per weight + an fp32 scale per output row
    assert int8.kv == bf16.kv and int8.lora == bf16.lora
    assert decode_step_bytes(SHAPE, [1024] * 64, [], weight_quant="fp8") == int8
    with pytest.raises(ValueError, match="weight_quant: int8, fp8 or None, got 'int4'"):
        step_bytes(SHAPE, 1, 0, [], weight_quant="int4")


def test_roofline_ratio():
    step = decode_step_bytes(SHAPE, [1024] * 64, [])
    out = roofline(step, bandwidth=4.24e12, measured_step_s=0.005)
    assert out["floor_s"] == pytest.approx(step.total / 4.24e12)
    assert out["measured_over_floor"] == pytest.approx(0.005 / out["floor_s"])


def test_workload_floor_sums_each_step_with_its_own_adapters():
    from loraplex.bench.instrument import StepRecord

    def decode(n_adapters, ctx=1024):
        return StepRecord(64, 64, 64 * ctx, frozenset(range(1, n_adapters + 1)))

    prefill = StepRecord(8, 8 * 1024, 8 * 1024, frozenset({1, 2}))
    base = workload_floor([decode(0)] * 10, SHAPE, lambda a: 16, 2, bandwidth=4.24e12)
    lora = workload_floor([prefill] + [decode(64)] * 10, SHAPE, lambda a: 16, 2, bandwidth=4.24e12)
    one = decode_step_bytes(SHAPE, [1024] * 64, [16] * 64)
    assert lora["lora_bytes"] == 10 * one.lora + 2 * 16 * SHAPE.lora_params_per_rank() * 2
    assert one.lora == pytest.approx(5.37e9, rel=0.01)  # 64 distinct rank-16 adapters: +5.4 GB every step
    assert lora["num_steps"] == 11 and lora["num_decode_steps"] == 10
    assert lora["mean_decode_adapters"] == 64 and lora["mean_decode_batch"] == 64 and lora["max_step_adapters"] == 64
    assert lora["mean_decode_context"] == 1024
    assert base["floor_s"] == pytest.approx(10 * decode_step_bytes(SHAPE, [1024] * 64, []).total / 4.24e12)
    # same output tokens: the ÷ base ratio the roofline allows is the ratio of the floors: ~0.81 when every decode
    # step of batch 64 at context 1,024 carries 64 distinct rank-16 adapters
    distinct = workload_floor([decode(64)] * 10, SHAPE, lambda a: 16, 2, bandwidth=4.24e12)
    assert base["floor_s"] / distinct["floor_s"] == pytest.approx(23.6 / (23.6 + 5.37), rel=0.01)
    mixed = workload_floor([decode(ranks) for ranks in (1, 1)], SHAPE, lambda a: 64, 2, bandwidth=1.0)
    assert mixed["lora_bytes"] == 2 * 64 * SHAPE.lora_params_per_rank() * 2  # each adapter at its real rank


def test_step_bytes_of_a_prefill_step():
    step = step_bytes(SHAPE, num_tokens=2048, context_tokens=4096, adapter_ranks=[16])
    assert step.kv == 4096 * SHAPE.kv_bytes_per_token(2)
    assert step.weights - decode_step_bytes(SHAPE, [1], []).weights == 2047 * SHAPE.hidden_size * 2  # embedding rows


def test_a_prefill_step_is_compute_bound_and_a_decode_step_memory_bound():
    from loraplex.bench.instrument import StepRecord

    assert SHAPE.linear_params() == pytest.approx(6.98e9, rel=0.01)  # Llama-3-8B without embedding and LM head
    prefill = StepRecord(8, 8 * 1024, 8 * 1024, frozenset(), num_sampled=8)
    decode = StepRecord(64, 64, 64 * 1024, frozenset(range(1, 65)), num_sampled=64)
    flops_rate, bw = 7.9e14, 4.24e12
    only_hbm = workload_floor([prefill, decode], SHAPE, lambda a: 16, 2, bw)
    both = workload_floor([prefill, decode], SHAPE, lambda a: 16, 2, bw, flops_per_s=flops_rate)
    prefill_compute = step_flops(SHAPE, 8192, 8) / flops_rate  # ~0.145 s: 8,192 tokens through 7 B weights
    decode_hbm = step_bytes(SHAPE, 64, 64 * 1024, [16] * 64).total / bw  # ~6.9 ms
    assert prefill_compute > step_bytes(SHAPE, 8192, 8192, []).total / bw
    assert step_flops(SHAPE, 64, 64) / flops_rate < decode_hbm
    assert both["floor_s"] == pytest.approx(prefill_compute + decode_hbm)
    assert both["num_compute_bound_steps"] == 1 and both["hbm_floor_s"] == only_hbm["floor_s"]
    assert only_hbm["flops"] is None and both["flops"] == step_flops(SHAPE, 8192, 8) + step_flops(SHAPE, 64, 64)


def test_an_fp8_cache_halves_the_kv_bytes_of_the_floor_only():
    bf16 = decode_step_bytes(SHAPE, [1024] * 64, [16] * 8)
    fp8 = decode_step_bytes(SHAPE, [1024] * 64, [16] * 8, kv_elem_bytes=1)
    assert fp8.kv * 2 == bf16.kv == 64 * 1024 * 128 * 1024  # 64 KiB per token (KERNELS.md)
    assert (fp8.weights, fp8.lora) == (bf16.weights, bf16.lora)


def test_quant_bench_smoke_writes_its_report(tmp_path, monkeypatch):
    """The INT8 linear bench on tiny shapes (CPU, interpreter): every row measured, the kernel equal to its twin."""
    import json
    import os

    os.environ["TRITON_INTERPRET"] = "1"
    from loraplex.bench import quant_bench

    out = tmp_path / "q.json"
    assert quant_bench.main(["--smoke", "--sweep", "--out", str(out)]) == 0
    fp8 = tmp_path / "f.json"
    assert quant_bench.main(["--smoke", "--method", "fp8", "--out", str(fp8)]) == 0
    assert json.loads(fp8.read_text())["method"] == "fp8"
    payload = json.loads(out.read_text())
    assert len(payload["rows"]) == 4 and all(r["us_int8"] > 0 and r["max_abs_err_vs_twin"] < 1e-4
                                             for r in payload["rows"])
    assert all("best_blocks" in r for r in payload["rows"])
    assert "| q|k|v (64 -> 96) | 20 |" in out.with_suffix(".md").read_text()
