"""Engines on the tiny fixture models, shared per module (loading takes a fraction of a second)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """The tiny models' ops take microseconds; on a shared 2-core machine intra-op threads only add
    contention (20x slower under load). Restored after each test so other areas keep their setting."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_mistral_tied(tmp_path_factory) -> dict:
    """Mistral architecture with tied input/output embeddings and MHA (no GQA)."""
    from loraplex.demo import DemoModelSpec, build_demo_model

    spec = DemoModelSpec(arch="mistral", heads=4, kv_heads=4, tie_word_embeddings=True, adapters=0, seed=4)
    return build_demo_model(tmp_path_factory.mktemp("tiny-mistral"), spec)


@pytest.fixture(scope="module")
def hf_llama(tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model["model_dir"], dtype=torch.float32).eval()


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """HF greedy ``generate`` with EOS off, like the engine's ignore_eos. (min_new_tokens would instead mask
    the EOS logits, changing the argmax where a random model's top token is EOS.)"""
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None  # generate() falls back to this for an unset eos
    ids = torch.tensor([prompt_ids])
    try:
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=model.config.pad_token_id)
    finally:
        model.generation_config.eos_token_id = saved
    assert out.shape[1] == ids.shape[1] + max_new_tokens
    return out[0, ids.shape[1]:].tolist()


def hf_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    """log_softmax of Hugging Face's logits at every position: [len, V]."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


@pytest.fixture
def lora_steps(monkeypatch) -> list:
    """Every ``LoRAStep`` built while the test runs, in order (the engine's per-step LoRA mappings)."""
    from loraplex.adapters.mapping import LoRAStep

    steps: list = []
    init = LoRAStep.__init__

    def recording(self, *args, **kwargs):
        init(self, *args, **kwargs)
        steps.append(self)

    monkeypatch.setattr(LoRAStep, "__init__", recording)
    return steps
