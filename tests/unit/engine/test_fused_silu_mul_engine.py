"""Engine option ``fuse_lora_silu_mul`` (gate|up's LoRA delta added inside SiLU-and-multiply) on the CPU: the same
tokens and logprobs as the unfused path in fp32, eager and on the padded graph path, with adapters of mixed ranks
and base requests in the same steps, and the fused call really made."""

from __future__ import annotations

import pytest
import torch

from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.adapters.mapping import LoRAStep
from tests.conftest import adapter_dir


@pytest.mark.parametrize("padded", [False, True])
def test_fused_silu_mul_gives_the_unfused_tokens(tiny_model, padded, monkeypatch):
    loras = [LoRARequest(f"a{i}", i + 1, adapter_dir(tiny_model, i)) for i in range(3)]
    mix = [loras[0], None, loras[1], loras[2], loras[0], None, loras[1]]
    prompts = [{"prompt_token_ids": [1] + [5 + 17 * i + j for j in range(4 + 7 * i)]} for i in range(len(mix))]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1)

    def run(fuse: bool):
        llm = LLM(tiny_model["model_dir"], dtype="float32", enable_lora=True, max_loras=4, max_num_seqs=16,
                  fuse_lora_silu_mul=fuse)
        if padded:
            llm.engine.runner.graphs = llm.engine.runner.make_graph_runner(capture=False)
        return llm, llm.generate(prompts, params, lora_request=mix)

    calls = []
    fused = LoRAStep.silu_mul
    monkeypatch.setattr(LoRAStep, "silu_mul", lambda self, *a: calls.append(1) or fused(self, *a))
    _, want = run(False)
    assert not calls
    llm, got = run(True)
    assert len(calls) >= len(llm.engine.runner.model.layers) * 8  # every layer of every step with adapters
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for lw, lg in zip(w.outputs[0].logprobs, g.outputs[0].logprobs):
            (t, v), = lw.items()
            assert lg[t].logprob == pytest.approx(v.logprob, abs=1e-4)


def test_silu_mul_min_tokens_fuses_only_the_large_steps(tiny_model, monkeypatch):
    """lora_silu_mul_min_tokens: prompt steps (at least the threshold) go through the fused call, the decode steps
    (one token per sequence, below it) do not; tokens and logprobs as the unfused path."""
    loras = [LoRARequest(f"a{i}", i + 1, adapter_dir(tiny_model, i)) for i in range(2)]
    mix = [loras[0], loras[1], None, loras[0]]
    prompts = [{"prompt_token_ids": [1] + [7 + 13 * i + j for j in range(10 + 3 * i)]} for i in range(len(mix))]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=1)
    steps = []
    fused = LoRAStep.silu_mul
    monkeypatch.setattr(LoRAStep, "silu_mul",
                        lambda self, layer, x, *a: steps.append((layer, x.shape[0])) or fused(self, layer, x, *a))

    def run(**options):
        llm = LLM(tiny_model["model_dir"], dtype="float32", enable_lora=True, max_loras=4, max_num_seqs=16,
                  **options)
        return llm.generate(prompts, params, lora_request=mix)

    want = run()
    assert not steps
    got = run(lora_silu_mul_min_tokens=16)
    layers = {layer for layer, _ in steps}
    assert steps and min(t for _, t in steps) >= 16  # prompt steps only: the 4-token decode steps are not fused
    assert len(steps) == len(layers) * len({t for _, t in steps}) and len(layers) >= 2  # every layer of those
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for lw, lg in zip(w.outputs[0].logprobs, g.outputs[0].logprobs):
            (t, v), = lw.items()
            assert lg[t].logprob == pytest.approx(v.logprob, abs=1e-4)
    with pytest.raises(ValueError, match="lora_silu_mul_min_tokens must be >= 0"):
        run(lora_silu_mul_min_tokens=-1)


def test_fold_shrink_option_reaches_the_lora_manager_and_is_checked(tiny_model):
    """lora_fold_shrink_max_tokens (the down shrink inside SiLU-and-multiply, Triton only: the CPU's twins never fold;
    its effect is tested on CUDA, tests/gpu/test_lora_fold_gpu.py): the manager plans it, a negative value is refused."""
    llm = LLM(tiny_model["model_dir"], dtype="float32", enable_lora=True, max_loras=4, max_num_seqs=4,
              lora_fold_shrink_max_tokens=64)
    manager = llm.engine.runner.get_lora_manager()
    assert manager.fold_shrink_max_tokens == 64 and manager.kernel_options().fold_shrink_max_tokens == 64
    step = manager.make_step(torch.tensor([0, -1, 1], dtype=torch.int32), 2)
    assert not step.folds_down_shrink  # the twins run on the CPU
    with pytest.raises(ValueError, match="lora_fold_shrink_max_tokens must be >= 0"):
        LLM(tiny_model["model_dir"], dtype="float32", enable_lora=True, lora_fold_shrink_max_tokens=-1)
