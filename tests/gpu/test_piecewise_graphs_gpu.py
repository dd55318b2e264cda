"""Piecewise CUDA graphs of prefill and mixed steps (engine option ``piecewise_cuda_graphs``) against the same
engine with those steps eager: fp32 and bf16, adapters mixed with base requests, many mixed steps (a small token
budget chunks the prompts), steps past the largest token bucket, and a second run replaying the captured graphs
with other prompts, adapters and block tables than at capture."""

from __future__ import annotations

import pytest
import torch

from loraplex import SamplingParams
from tests.gpu.test_cuda_graphs import _compare, generate_with, mixed_requests

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_piecewise_graphs_match_eager_mixed_steps(tiny_model, dtype):
    requests = mixed_requests(tiny_model, seed=11, num_requests=40)
    _, eager = generate_with(tiny_model, dtype, requests, max_num_batched_tokens=96, piecewise_cuda_graphs=False)
    llm, graphs = generate_with(tiny_model, dtype, requests, max_num_batched_tokens=96,
                                piecewise_cuda_graphs=True, piecewise_graph_max_tokens=96)
    pw = llm.engine.runner.piecewise
    assert pw is not None and pw.num_graphs == len(pw.buckets) * 2 * pw.num_pieces  # all captured at start-up
    assert pw.num_steps > 0 and True in {mode for _, mode in pw.used_keys}
    assert _compare(eager, graphs, dtype) > (300 if dtype == "float32" else 150)

    # replays with other contents: another prompt set and adapter order on the same captured graphs
    prompts, mix, params = mixed_requests(tiny_model, seed=12, num_requests=30)
    steps = pw.num_steps
    again = llm.generate(prompts, params, lora_request=mix)
    _, want = generate_with(tiny_model, dtype, (prompts, mix, params), max_num_batched_tokens=96,
                            piecewise_cuda_graphs=False)
    assert pw.num_steps > steps
    assert _compare(want, again, dtype) > (200 if dtype == "float32" else 100)


def test_piecewise_graphs_prompt_logprobs(tiny_model):
    """Prompt logprobs read every row of a step's hidden states (the graphs' static output buffer)."""
    prompts, mix, _ = mixed_requests(tiny_model, seed=13, num_requests=12)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    _, eager = generate_with(tiny_model, "float32", (prompts, mix, params), piecewise_cuda_graphs=False)
    _, graphs = generate_with(tiny_model, "float32", (prompts, mix, params), piecewise_cuda_graphs=True)
    for e, g in zip(eager, graphs):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids
        for le, lg in zip(e.prompt_logprobs, g.prompt_logprobs):
            if le is None:
                assert lg is None
                continue
            for tok, lp in le.items():
                assert lg[tok].logprob == pytest.approx(lp.logprob, abs=2e-3)
