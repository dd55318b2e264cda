"""INT8 weight-only quantization of the base model (``quantization="int8"``) on the CPU: the engine computes
exactly what the same engine computes over a checkpoint holding the dequantized weights (greedy tokens and
logprobs, with adapters, chunked prefill and speculative decoding), and what Hugging Face computes on them."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.engine.config import EngineConfig
from loraplex.engine.quant import QuantizedWeight
from tests.conftest import adapter_dir, dequantized_copy


@pytest.fixture(scope="module")
def dequantized_dir(tiny_model, tmp_path_factory) -> Path:
    return dequantized_copy(tiny_model["model_dir"], tmp_path_factory.mktemp("dequantized"))


def _prompts(seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [1] + [rng.randrange(8, 500) for _ in range(n)]} for n in (3, 17, 40, 90)]


def _outputs(llm, prompts, params, loras=None):
    return [o.outputs[0] for o in llm.generate(prompts, params, lora_request=loras)]


def test_int8_engine_equals_the_engine_on_the_dequantized_checkpoint(tiny_model, dequantized_dir):
    kw = dict(dtype="float32", enable_lora=True, max_loras=2, max_num_batched_tokens=32, seed=3)
    quant = LLM(tiny_model["model_dir"], quantization="int8", **kw)
    plain = LLM(str(dequantized_dir), **kw)
    layer = quant.engine.runner.model.layers[0]
    assert isinstance(layer.qkv_weight, QuantizedWeight) and layer.down_weight.qweight.dtype == torch.int8
    assert quant.engine.runner.weight_bytes_freed > 0
    prompts = _prompts(1)
    loras = [None, LoRARequest("a1", 1, adapter_dir(tiny_model, 1)), LoRARequest("a3", 2, adapter_dir(tiny_model, 3)),
             None]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=2)
    got, want = _outputs(quant, prompts, params, loras), _outputs(plain, prompts, params, loras)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        for lg, lw in zip(g.logprobs, w.logprobs):
            for tok, entry in lw.items():
                assert lg[tok].logprob == pytest.approx(entry.logprob, abs=1e-5)
    # with speculative drafts on top, the same greedy tokens
    spec = LLM(tiny_model["model_dir"], quantization="int8", num_speculative_tokens=3, **kw)
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    assert [o.token_ids for o in _outputs(spec, prompts, greedy, loras)] == [w.token_ids for w in want]


def test_int8_engine_gives_hf_greedy_tokens_on_the_dequantized_weights(dequantized_dir, tiny_model):
    from transformers import AutoModelForCausalLM

    from tests.unit.engine.conftest import hf_greedy

    hf = AutoModelForCausalLM.from_pretrained(str(dequantized_dir), dtype=torch.float32).eval()
    llm = LLM(tiny_model["model_dir"], quantization="int8", dtype="float32", max_num_batched_tokens=24)
    prompts = _prompts(2)
    outs = _outputs(llm, prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(hf, p["prompt_token_ids"], 8)


def test_fp8_engine_equals_the_engine_on_its_dequantized_checkpoint(tiny_model, tmp_path):
    kw = dict(dtype="float32", enable_lora=True, max_loras=2, max_num_batched_tokens=32, seed=3)
    quant = LLM(tiny_model["model_dir"], quantization="fp8", **kw)
    assert quant.engine.runner.model.layers[1].o_weight.qweight.dtype == torch.float8_e4m3fn
    plain = LLM(str(dequantized_copy(tiny_model["model_dir"], tmp_path, "fp8")), **kw)
    prompts = _prompts(3)
    loras = [LoRARequest("a2", 1, adapter_dir(tiny_model, 2)), None, None, LoRARequest("a2", 1, adapter_dir(tiny_model, 2))]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=1)
    for g, w in zip(_outputs(quant, prompts, params, loras), _outputs(plain, prompts, params, loras)):
        assert g.token_ids == w.token_ids
        for lg, lw in zip(g.logprobs, w.logprobs):
            for tok, entry in lw.items():
                assert lg[tok].logprob == pytest.approx(entry.logprob, abs=1e-5)


def test_quantization_options_are_checked():
    with pytest.raises(ValueError, match="quantization must be one of int8, fp8 \\(or None\\), got 'int4'"):
        EngineConfig(quantization="int4")
    with pytest.raises(ValueError, match="merge_single_lora cannot fold an adapter into quantized weights"):
        EngineConfig(quantization="int8", enable_lora=True, merge_single_lora=True)


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_dequantize_into_scratch_gives_the_twins_values_and_reuses_the_buffer(method):
    """The large-step path's dequantization (CUDA uses it with cuBLAS): exactly ``dequantize()``'s values, in bf16 and
    fp32, written into the weight's scratch; a smaller weight sharing that buffer reuses it."""
    from loraplex.engine.quant import QUANTIZERS, dequantize_into_scratch

    gen = torch.Generator().manual_seed(3)
    big = QUANTIZERS[method](torch.randn(96, 64, generator=gen))
    small = QUANTIZERS[method](torch.randn(32, 64, generator=gen))
    for dtype in (torch.bfloat16, torch.float32):
        got = dequantize_into_scratch(big, dtype)
        assert got.dtype == dtype and torch.equal(got, big.dequantize(dtype))
        small.scratch = big.scratch
        again = dequantize_into_scratch(small, dtype)
        assert again.data_ptr() == big.scratch.data_ptr() and torch.equal(again, small.dequantize(dtype))
