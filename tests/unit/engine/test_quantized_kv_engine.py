"""The engine over a quantized KV cache on the CPU: float8 e4m3 (``kv_cache_dtype="fp8"``) and INT8 with a scale
per (token, KV head) row (``"int8"``). The twins store and read them as the Triton kernels do
(tests/unit/kernels/test_fp8_kv.py and test_int8_kv.py hold those to the twins): the cache's type and size,
closeness to the unquantized engine, copy-on-write of forked samples, prefix caching, LoRA, stats."""

from __future__ import annotations

import random

import pytest
import torch

from loraplex import LLM, SamplingParams
from loraplex.engine.config import EngineConfig
from tests.conftest import adapter_dir

FP8 = torch.float8_e4m3fn
TYPES = {"fp8": FP8, "int8": torch.int8}


def _prompts(seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(8, 512) for _ in range(n)] for n in (3, 17, 40, 90)]


@pytest.fixture(scope="module", params=["fp8", "int8"])
def quant_llm(tiny_model, request):
    return LLM(tiny_model["model_dir"], dtype="float32", kv_cache_dtype=request.param, max_num_batched_tokens=32,
               enable_lora=True, max_loras=2, seed=5)


def test_config_accepts_fp8_names_and_rejects_others():
    for name in ("auto", "fp8", "fp8_e4m3", "int8"):
        assert EngineConfig(kv_cache_dtype=name).kv_cache_dtype == name
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3, int8, got 'int4'"):
        EngineConfig(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="got 'fp16'"):
        EngineConfig(kv_cache_dtype="fp16")


def test_quantized_caches_hold_more_blocks_in_the_same_memory(tiny_model):
    counts, per_block = {}, {}
    for kv in ("auto", "fp8", "int8"):
        llm = LLM(tiny_model["model_dir"], dtype="float32", kv_cache_dtype=kv, kv_cache_memory_gb=0.001,
                  max_model_len=256)
        runner = llm.engine.runner
        layer = runner.kv_caches[0]
        assert layer.key.dtype == layer.value.dtype == TYPES.get(kv, torch.float32)
        assert (layer.key_scale is not None) == (kv == "int8")
        if kv == "int8":
            assert layer.key_scale.shape == layer.key.shape[:3] and layer.key_scale.dtype == torch.float32
        counts[kv], per_block[kv] = llm.engine.block_manager.num_blocks, runner.bytes_per_block()
        assert per_block[kv] == sum(t[0].numel() * t.element_size() for t in layer.tensors()) * len(runner.kv_caches)
    head_dim = runner.model_config.head_dim
    assert per_block["auto"] == 4 * per_block["fp8"]  # fp32 on the CPU: 4 bytes per value, fp8 1
    assert per_block["int8"] * head_dim == per_block["fp8"] * (head_dim + 4)  # + a 4-byte scale per row
    assert counts["fp8"] // counts["auto"] == 4 and counts["fp8"] > counts["int8"] > 3 * counts["auto"]


def test_prompt_logprobs_stay_close_to_the_unquantized_engine(tiny_model, quant_llm):
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, prompt_logprobs=0)
    prompts = [{"prompt_token_ids": p} for p in _prompts()]
    exact = LLM(tiny_model["model_dir"], dtype="float32", max_num_batched_tokens=32).generate(prompts, params)
    quant = quant_llm.generate(prompts, params)

    def logprobs(outs):
        return torch.tensor([next(iter(d.values())).logprob for o in outs for d in o.prompt_logprobs[1:]])

    diff = (logprobs(exact) - logprobs(quant)).abs()
    assert diff.numel() == sum(len(p) - 1 for p in _prompts())
    # the stored K/V are rounded: the logprobs move, by little (fp8: measured mean 0.085, max 0.54 on this random
    # model, whose logprobs are ~-7.4; int8's row scales keep ~7 bits and move them less)
    assert 0 < diff.mean() < 0.25 and diff.max() < 1.5, (diff.mean(), diff.max())
    if quant_llm.engine.config.kv_cache_dtype == "int8":
        assert diff.mean() < 0.05, diff.mean()
    first_tokens = [o.outputs[0].token_ids[0] for o in exact], [o.outputs[0].token_ids[0] for o in quant]
    assert sum(a == b for a, b in zip(*first_tokens)) >= 3, first_tokens


def test_forked_samples_copy_the_block_they_share(quant_llm):
    engine = quant_llm.engine
    prompt = [1] + list(range(40, 80))  # 41 tokens: 2 full blocks + 9 in a third
    engine.add_request("n3", prompt, SamplingParams(n=3, max_tokens=12, temperature=1.0, seed=7, ignore_eos=True))
    copies = engine.block_manager.num_cow_copies
    for _ in range(4):  # the prompt in two chunks (32-token steps), the fork, then the copies
        engine.step()
        if engine.block_manager.num_cow_copies > copies:
            break
    samples = engine.scheduler.samples["n3"]
    third = [s.block_ids[2] for s in samples]  # each sample wrote into the shared partial block: copy-on-write
    assert len(set(third)) == 3
    for kv in engine.runner.kv_caches:
        for cache in kv.tensors():  # K, V and, for int8, their row scales
            rows = cache.view(torch.uint8)[third, :9]  # the prompt's 9 tokens in each copy: the same bytes
            assert torch.equal(rows[0], rows[1]) and torch.equal(rows[0], rows[2])
            assert rows.any()
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_prefix_cache_hit_and_adapters_over_a_quantized_cache(tiny_model, quant_llm):
    from loraplex import LoRARequest

    prompt = {"prompt_token_ids": _prompts(9)[3]}
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    lora = LoRARequest("a0", 1, adapter_dir(tiny_model, 0))
    first = quant_llm.generate(prompt, params, lora_request=lora)[0].outputs[0].token_ids
    hits = quant_llm.engine.block_manager.num_prefix_hit_tokens
    again = quant_llm.generate(prompt, params, lora_request=lora)[0].outputs[0].token_ids
    assert quant_llm.engine.block_manager.num_prefix_hit_tokens >= hits + 80  # the prompt's 5 full blocks
    assert again == first  # the cached quantized prefix gives the tokens the fresh prefill gave
    base = quant_llm.generate(prompt, params)[0].outputs[0].token_ids
    assert base != first  # the adapter ran (the same prompt without it generates otherwise)


def test_stats_and_metrics_show_the_cache_type(quant_llm):
    from loraplex.platform.metrics import Metrics

    stats = quant_llm.engine.get_stats()
    want = str(TYPES[quant_llm.engine.config.kv_cache_dtype]).removeprefix("torch.")
    assert stats.kv_cache_dtype == want and stats.block_size == 16
    assert stats.num_kv_blocks == quant_llm.engine.block_manager.num_blocks > 0
    metrics = Metrics()
    metrics.attach_engine(lambda: "tiny", quant_llm.engine.get_stats, max_loras=2)
    info = [line for line in metrics.render().decode().splitlines() if line.startswith("vllm:cache_config_info")]
    assert len(info) == 1 and f'cache_dtype="{want}"' in info[0] and info[0].endswith(" 1.0")
    assert f'num_gpu_blocks="{stats.num_kv_blocks}"' in info[0] and 'block_size="16"' in info[0]
