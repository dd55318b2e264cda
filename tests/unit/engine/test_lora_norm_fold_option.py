"""Engine option ``lora_norm_fold_max_tokens`` on the CPU (the twins run the same order as the CUDA kernels): steps of
at most that many tokens leave o's and down's expand to the residual add + RMSNorm after each (down's to the next
layer's input norm, the last layer's to the final norm), larger steps take the usual path, and the greedy tokens and
logprobs are those of the usual path; alone and with the in-GEMM shrink. The kernel itself is checked through the
interpreter (tests/unit/kernels/test_lora_add_rms_norm.py) and on CUDA (tests/gpu/test_lora_add_rms_norm_gpu.py)."""

from __future__ import annotations

import pytest

from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.adapters.mapping import LoRAStep
from loraplex.engine.config import EngineConfig
from tests.conftest import adapter_dir


@pytest.fixture
def folds(monkeypatch) -> list:
    """(layer, proj) of every delta an ``add_rms_norm`` added, in order."""
    added: list = []
    original = LoRAStep.add_rms_norm

    def recording(self, *args, **kwargs):
        if self._deferred is not None:
            added.append(self._deferred[:2])
        return original(self, *args, **kwargs)

    monkeypatch.setattr(LoRAStep, "add_rms_norm", recording)
    return added


def _run(tiny_model, **options):
    loras = [LoRARequest(f"a{i}", i + 1, adapter_dir(tiny_model, i)) for i in range(3)]
    mix = [loras[0], None, loras[1], loras[0], loras[2], loras[1]]
    prompts = [{"prompt_token_ids": [1] + [7 + 13 * i + j for j in range(5 + 3 * i)]} for i in range(len(mix))]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0)
    llm = LLM(tiny_model["model_dir"], dtype="float32", enable_lora=True, max_loras=4, max_num_seqs=8, **options)
    return llm, llm.generate(prompts, params, lora_request=mix)


def _assert_same(got, want) -> None:
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for lg, lw in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            tok = next(iter(lw))
            assert abs(lg[tok].logprob - lw[tok].logprob) < 1e-4


def test_norm_fold_decodes_the_same_tokens(tiny_model, lora_steps, folds):
    assert EngineConfig(model="m").lora_norm_fold_max_tokens == 0
    with pytest.raises(ValueError, match="lora_norm_fold_max_tokens must be >= 0"):
        EngineConfig(model="m", lora_norm_fold_max_tokens=-1).resolve(tiny_model["model_dir"])
    _, want = _run(tiny_model)
    assert not any(s.fold_norm for s in lora_steps) and not folds
    lora_steps.clear()
    llm, got = _run(tiny_model, lora_norm_fold_max_tokens=8)
    assert llm.engine.runner.lora_manager.norm_fold_max_tokens == 8
    folded = [s for s in lora_steps if s.fold_norm]
    assert folded and any(s.num_active and not s.fold_norm for s in lora_steps)  # decode steps fold, prompts not
    assert all(s.token_slots.shape[0] <= 8 for s in folded)
    assert not any(s.has_deferred for s in lora_steps), "every deferred delta was added"
    layers = len(llm.engine.runner.model.layers)
    per_step = [(i, p) for i in range(layers) for p in ("o", "down")]
    assert folds[:len(per_step)] == per_step  # o's by its norm, down's by the next layer's (the last: the final norm)
    _assert_same(got, want)


def test_norm_fold_with_the_in_gemm_shrink(tiny_model, lora_steps, folds):
    _, want = _run(tiny_model)
    lora_steps.clear()
    _, got = _run(tiny_model, lora_norm_fold_max_tokens=64, lora_gemm_shrink=True)
    assert any(s.fold_norm and s.gemm_shrink for s in lora_steps)
    _assert_same(got, want)


def test_linear_deferred_refuses_what_cannot_fold(tiny_model):
    llm, _ = _run(tiny_model, lora_norm_fold_max_tokens=8)
    manager = llm.engine.runner.lora_manager
    import torch

    layer = llm.engine.runner.model.layers[0]
    step = manager.make_step(torch.tensor([0, 1], dtype=torch.int32), 2)
    assert step.fold_norm
    x = torch.randn(2, layer.o_weight.shape[1])
    with pytest.raises(ValueError, match="only o and down fold into a norm"):
        step.linear_deferred(0, "qkv", x, layer.o_weight)
    step.linear_deferred(0, "o", x, layer.o_weight)
    with pytest.raises(RuntimeError, match="layer 0's o was never added"):
        step.linear_deferred(0, "o", x, layer.o_weight)
