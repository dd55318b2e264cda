"""Roofline arithmetic on the Llama-3-8B shape (the figures KERNELS.md derives by hand)."""

from __future__ import annotations

import pytest

from loraplex.bench.llama8b import RandomModelSpec, hf_config
from loraplex.bench.roofline import ModelShape, decode_step_bytes, roofline

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


def test_roofline_ratio():
    step = decode_step_bytes(SHAPE, [1024] * 64, [])
    out = roofline(step, bandwidth=4.24e12, measured_step_s=0.005)
    assert out["floor_s"] == pytest.approx(step.total / 4.24e12)
    assert out["measured_over_floor"] == pytest.approx(0.005 / out["floor_s"])
