"""Engine option ``fuse_lora_silu_mul`` (gate|up's LoRA delta added inside SiLU-and-multiply) on the CPU: the same
tokens and logprobs as the unfused path in fp32, eager and on the padded graph path, with adapters of mixed ranks
and base requests in the same steps, and the fused call really made."""

from __future__ import annotations

import pytest

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
