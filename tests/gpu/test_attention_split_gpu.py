"""Mixed steps (decodes and prompts together): the leading one-token sequences through the split-KV decode kernel,
the rest through the varlen kernel (engine option ``attention_decode_split``), against every row through the
varlen kernel. Same greedy tokens and logprobs, and the split really ran in mixed steps."""

from __future__ import annotations

import pytest
import torch

import loraplex.kernels.paged_attention as pa
from tests.gpu.test_cuda_graphs import _compare, generate_with, mixed_requests

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mixed_steps_split_decodes_from_prompts(tiny_model, dtype, monkeypatch):
    calls = {"mixed": 0, "split": 0}
    attention = pa.paged_attention

    def counted(query, *args, max_query_len=None, num_decodes=0, **kwargs):
        if max_query_len is not None and max_query_len > 1:  # a step with prompt tokens (eager)
            calls["mixed"] += 1
            calls["split"] += num_decodes > 0
        return attention(query, *args, max_query_len=max_query_len, num_decodes=num_decodes, **kwargs)

    requests = mixed_requests(tiny_model, seed=5, num_requests=40)
    # a small token budget: prompts are chunked and admitted while others decode (many mixed steps)
    _, whole = generate_with(tiny_model, dtype, requests, max_num_batched_tokens=96, attention_decode_split=False)
    monkeypatch.setattr(pa, "paged_attention", counted)  # the Triton backend imports it when the engine starts
    _, split = generate_with(tiny_model, dtype, requests, max_num_batched_tokens=96,
                            attention_decode_split=True)
    assert calls["split"] > 0 and calls["split"] < calls["mixed"]  # mixed steps split; prompt-only steps did not
    assert _compare(whole, split, dtype) > (300 if dtype == "float32" else 150)
