"""The sampler on CUDA queues its work without a stream sync for every feature (top-k/p, min-p, penalties and
bad_words with an in-flight token, allowed_token_ids, logit_bias, seeds, logprobs): with overlapped steps a sync
would drain the queue every step. Checked with torch's sync debug mode, which raises on a synchronizing call."""

from __future__ import annotations

import pytest
import torch

from loraplex import SamplingParams
from loraplex.engine.sampler import Sampler, SampleRow

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.7, top_p=0.9),
    SamplingParams(temperature=1.0, top_k=5),
    SamplingParams(temperature=1.0, min_p=0.1),
    SamplingParams(temperature=0.8, seed=11),
    SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2),
    SamplingParams(temperature=0.9, logprobs=3, seed=5, top_p=0.8),
    SamplingParams(temperature=0.0, logprobs=0),
    SamplingParams(temperature=0.9, allowed_token_ids=[3, 9, 27], logit_bias={9: 1.5, 500: -100}),
    SamplingParams(temperature=0.0, bad_words=["w"]),
]
# the bad-words row (output [5, 6, 7, -1], token 7 in flight): [7, 12] is banned on the device, [7, 8, 11] is not
BAD_WORDS = [[7, 8, 11], [7, 12], [13]]


def test_sampler_queues_every_feature_without_a_sync():
    dev = torch.device("cuda")
    vocab = 1000
    gen = torch.Generator(device=dev).manual_seed(0)
    logits = torch.randn(len(PARAMS), vocab, device=dev, generator=gen) * 3
    inflight = torch.tensor([7, 8, 9], device=dev)
    rows = [SampleRow(p, 0, 4, [1, 2, 3], [5, 6, 7, -1], inflight_src=i % 3,
                      bad_words_token_ids=BAD_WORDS if p.bad_words else ()) for i, p in enumerate(PARAMS)]
    sampler = Sampler(dev, seed=0)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = sampler.sample(logits, PARAMS, lambda: rows, None, inflight)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    tokens = out.token_ids.tolist()
    assert all(0 <= t < vocab for t in tokens)
    assert tokens[0] == int(logits[0].argmax())  # greedy
    assert tokens[2] in logits[2].topk(5).indices.tolist()  # top-k 5
    assert tokens[8] in (3, 9, 27) and tokens[9] not in (12, 13)  # allowed ids; bad words
    # penalized greedy row: the raw argmax unless a penalty moved it; either way a valid token
    assert out.ranks is not None and out.top_ids.shape == (len(PARAMS), 3)
    # the same seeded rows again give the same tokens (per-row generators), batch or not
    again = sampler.sample(logits, PARAMS, lambda: rows, None, inflight).token_ids.tolist()
    assert again[4] == tokens[4] and again[6] == tokens[6]


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                                    SamplingParams(temperature=0.8, top_p=0.9, top_k=20, min_p=0.05,
                                                   frequency_penalty=0.3, max_tokens=12, ignore_eos=True),
                                    SamplingParams(temperature=0.8, allowed_token_ids=list(range(0, 512, 3)),
                                                   logit_bias={6: 2.0}, bad_words=["the", "x"], max_tokens=12,
                                                   ignore_eos=True)],
                         ids=["greedy", "top-p-penalties", "token-restrictions"])
def test_overlapped_decode_steps_make_no_sync_but_the_result_wait(tiny_model, params):
    """Whole engine steps (graph replay, sampling, host bookkeeping) with overlapped steps: torch's sync debug
    mode reports no synchronizing call once every prompt is in (the one intended wait is an event's)."""
    import warnings

    from loraplex import LLM, LoRARequest
    from tests.conftest import adapter_dir

    llm = LLM(tiny_model["model_dir"], device="cuda", dtype="bfloat16", enable_lora=True, max_loras=4,
              max_lora_rank=64)
    engine = llm.engine
    assert engine.async_scheduling  # resolved at start-up (the config says None: on for CUDA)
    loras = [None] + [LoRARequest(f"a{k}", k + 1, adapter_dir(tiny_model, k)) for k in range(3)]
    for i in range(6):  # base rows and three adapters in every step (prefill steps run the eager LoRA path)
        engine.add_request(f"r{i}", [1] + list(range(20 + i, 60 + 3 * i)), params, lora_request=loras[i % 4])
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) or \
            engine.scheduler.waiting:
        engine.step()
    decode_steps = 0
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            while engine.has_unfinished_requests() and decode_steps < 8:
                engine.step()
                decode_steps += 1
    finally:
        torch.cuda.set_sync_debug_mode("default")
    while engine.has_unfinished_requests():
        engine.step()
    assert decode_steps >= 5
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message).lower()]
    assert not syncs, syncs[:3]


def test_penalty_rows_kept_on_the_device_without_a_sync_equal_the_lists():
    """Keyed rows (penalties counted across steps in ``penalty_state``) on CUDA: no stream sync on the steps after
    the first, in-flight tokens counted from the device, and the same penalized logits as counting the lists."""
    dev = torch.device("cuda")
    vocab = 1000
    params = SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2)
    gen = torch.Generator(device=dev).manual_seed(1)
    keyed, plain = Sampler(dev, seed=0), Sampler(dev, seed=0)
    outputs = [[5, 6], [7], []]
    for step in range(6):
        logits = torch.randn(3, vocab, device=dev, generator=gen) * 3
        inflight = torch.tensor([11 + step, 40 + step, 900 - step], device=dev)
        lists = [o + [-1] for o in outputs]  # each row's newest token still in flight
        rows = [SampleRow(params, 0, len(o), [1, 2, 3 + k], o, inflight_src=k) for k, o in enumerate(lists)]
        keyed_rows = [SampleRow(params, 0, len(o), [1, 2, 3 + k], o, inflight_src=k, key=(k, 0))
                      for k, o in enumerate(lists)]
        torch.cuda.synchronize()
        if step:
            torch.cuda.set_sync_debug_mode("error")
        try:
            a = keyed._apply_penalties(logits.clone(), keyed_rows, inflight)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        b = plain._apply_penalties(logits.clone(), rows, inflight)
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        for o, t in zip(outputs, inflight.tolist()):
            o.append(t)  # the host learns the in-flight token
    assert keyed._penalties.rebuilt == 3
