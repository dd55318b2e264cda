"""The start-up warm-up of the eager path (run on CUDA; forced here on the CPU twins) leaves no trace: the KV
cache and the LoRA slot pool are unchanged and outputs equal a fresh engine's."""

from __future__ import annotations

import torch

from loraplex import LoRARequest, SamplingParams
from loraplex.engine.config import EngineConfig
from loraplex.engine.engine_core import LLMEngine
from tests.conftest import adapter_dir


def _engine(tiny_model) -> LLMEngine:
    return LLMEngine(EngineConfig(model=tiny_model["model_dir"], dtype="float32", enable_lora=True, max_loras=3,
                                  max_num_batched_tokens=96, max_model_len=256))


def _generate(engine: LLMEngine, tiny_model) -> list[list[int]]:
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    for i, prompt in enumerate([[1, 4, 9, 16, 25], [1, 2, 3], [1, 7, 7, 7]]):
        lora = LoRARequest(f"a{i}", i + 1, adapter_dir(tiny_model, i)) if i else None
        engine.add_request(f"r{i}", prompt, params, lora_request=lora)
    got: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for d in engine.step():
            got.setdefault(d.request_id, []).extend(d.token_ids)
    return [got[f"r{i}"] for i in range(3)]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _pool_tensors(pool) -> list[torch.Tensor]:
    """Every tensor of the slot pool (weights A and B|T per module, ranks, scalings), cloned."""
    out = [pool.ranks.clone(), pool.scaling.clone()]
    for table in (pool.a, pool.bt):
        for key in sorted(table, key=str):
            value = table[key]
            out += [t.clone() for t in (value if isinstance(value, (list, tuple)) else [value])]
    return out


def test_warmup_leaves_cache_and_outputs_untouched(tiny_model):
    engine = _engine(tiny_model)
    assert engine.runner.warmup_eager() == 0  # nothing to compile on the CPU
    caches = [(kv.key.clone(), kv.value.clone()) for kv in engine.runner.kv_caches]
    pool = engine.runner.get_lora_manager().pool
    pool_before = _pool_tensors(pool)
    assert len(pool_before) > 2
    # budget and budget - 1 tokens, base / one adapter / max_loras adapters
    assert engine.runner.warmup_eager(force=True) == 6
    for (k, v, *_), (k0, v0) in zip(engine.runner.kv_caches, caches):
        # bitwise: the CPU cache is allocated uninitialized, and garbage may hold NaN patterns
        assert _same_bits(k, k0) and _same_bits(v, v0)
    assert all(_same_bits(a, b) for a, b in zip(_pool_tensors(pool), pool_before))
    assert _generate(engine, tiny_model) == _generate(_engine(tiny_model), tiny_model)
