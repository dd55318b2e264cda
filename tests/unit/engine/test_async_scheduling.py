"""Overlapped (asynchronous) scheduling gives exactly the outputs of synchronous steps.

The CPU runs the same code path as CUDA (placeholders, the device-side fix-up of input ids, provisional
bookkeeping, late results), only without real concurrency, so every case here is a real check: stop
tokens and stop strings met mid-run (the next step already ran those sequences), preemption while a
step is in flight (a tiny KV cache), forks and logprobs (steps that fall back to synchronous), adapters,
seeded random sampling, shared prefixes, and aborts with a step in flight.
"""

from __future__ import annotations

import pytest

from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.engine.config import EngineConfig
from loraplex.engine.engine_core import LLMEngine
from loraplex.engine.scheduler_output import PLACEHOLDER_TOKEN
from tests.conftest import adapter_dir
from tests.unit.engine.test_sampling_masks import encode_bad_words, two_token_word

PROMPTS = [[1, 17, 33, 95, 12], [1, 17, 33, 95, 12, 40, 41], [1, 300, 301], [1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14],
           [1, 200], [1, 17, 33, 95, 99, 98, 97, 96, 95, 94, 93, 92, 91, 90], [1, 60, 61, 62]]


def _run(tiny_model, async_on: bool, params, loras, **engine_kw):
    llm = LLM(tiny_model["model_dir"], dtype="float32", enable_lora=True, max_loras=2, max_num_seqs=8,
              async_scheduling=async_on, **engine_kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, lora_request=loras)
    _run.logprobs = [[c.logprobs for c in o.outputs] for o in outs]  # the last run's, for the caller
    return llm, [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outs]


def _assert_logprobs_close(got, want):
    """Per token: the same top tokens with the same ranks, logprobs within float32 reassociation (a batch
    that still holds a sequence stopped mid-step changes GEMM blocking on the CPU)."""
    for g_out, w_out in zip(got, want):
        for g, w in zip(g_out, w_out):
            assert (g is None) == (w is None)
            if w is None:
                continue
            assert len(g) == len(w)
            for g_tok, w_tok in zip(g, w):
                assert g_tok.keys() == w_tok.keys()
                for t, lp in w_tok.items():
                    assert g_tok[t].rank == lp.rank
                    assert g_tok[t].logprob == pytest.approx(lp.logprob, abs=1e-5)


def _workload(tiny_model, stop_token: int, stop_text: str):
    loras = [None, LoRARequest("a0", 1, adapter_dir(tiny_model, 0)), None,
             LoRARequest("a1", 2, adapter_dir(tiny_model, 1)), LoRARequest("a0", 1, adapter_dir(tiny_model, 0)),
             None, LoRARequest("a2", 3, adapter_dir(tiny_model, 2))]
    params = [
        SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=25, temperature=0, stop_token_ids=[stop_token]),
        SamplingParams(max_tokens=18, temperature=0.8, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=[stop_text]),
        SamplingParams(max_tokens=9, n=2, temperature=0.9, seed=5, ignore_eos=True),
        SamplingParams(max_tokens=15, temperature=0, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
    ]
    return params, loras


@pytest.mark.parametrize("kv_blocks", [None, 12])  # 12 blocks of 4 tokens: preemption under load
def test_async_outputs_equal_sync_outputs(tiny_model, kv_blocks):
    plain = [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)] * len(PROMPTS)
    _, probe = _run(tiny_model, False, plain, _workload(tiny_model, 0, "x")[1])
    # a stop token and a stop string that really occur mid-output, so sequences stop while the next step runs
    stop_token = probe[1][0][0][6]
    stop_text = probe[3][0][1][3:6] or "a"
    params, loras = _workload(tiny_model, stop_token, stop_text)
    kw = {"num_kv_blocks": kv_blocks, "block_size": 4} if kv_blocks else {}
    sync_llm, want = _run(tiny_model, False, params, loras, **kw)
    want_logprobs = _run.logprobs
    async_llm, got = _run(tiny_model, True, params, loras, **kw)
    assert got == want
    assert want_logprobs[5][0] and len(want_logprobs[5][0]) == len(want[5][0][0])  # logprobs=2 was honoured
    _assert_logprobs_close(_run.logprobs, want_logprobs)
    assert want[1][0][2] == "stop" and len(want[1][0][0]) < 25  # the stop token ended it early
    assert async_llm.engine.num_overlapped_steps > 10 and sync_llm.engine.num_overlapped_steps == 0
    if kv_blocks:
        assert async_llm.engine.scheduler.num_preemptions > 0
    for out in got:  # no placeholder ever reaches a user
        for token_ids, _, _ in out:
            assert PLACEHOLDER_TOKEN not in token_ids
    assert not async_llm.engine.has_unfinished_requests()
    assert async_llm.engine.block_manager.num_used_blocks == 0 or async_llm.engine.config.enable_prefix_caching


def test_abort_with_a_step_in_flight_reports_only_real_tokens(tiny_model):
    engine = LLMEngine(EngineConfig(model=tiny_model["model_dir"], dtype="float32", async_scheduling=True))
    params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    engine.add_request("keep", PROMPTS[0], params)
    engine.add_request("cut", PROMPTS[2], params)
    got: dict[str, list] = {"keep": [], "cut": []}
    for _ in range(6):
        for d in engine.step():
            got[d.request_id].append(d)
    assert engine._inflight is not None  # a step is running now, with placeholders in both sequences
    engine.abort_request("cut")
    while engine.has_unfinished_requests():
        for d in engine.step():
            got[d.request_id].append(d)
    cut_tokens = [t for d in got["cut"] for t in d.token_ids]
    final = got["cut"][-1]
    assert final.finished and final.finish_reason == "abort"
    assert PLACEHOLDER_TOKEN not in cut_tokens and final.num_generated_tokens == len(cut_tokens) > 0
    keep_tokens = [t for d in got["keep"] for t in d.token_ids]
    assert len(keep_tokens) == 50 and got["keep"][-1].num_generated_tokens == 50
    sync = LLMEngine(EngineConfig(model=tiny_model["model_dir"], dtype="float32", async_scheduling=False))
    sync.add_request("keep", PROMPTS[0], params)
    ref = []
    while sync.has_unfinished_requests():
        ref += [t for d in sync.step() for t in d.token_ids]
    assert keep_tokens == ref


def test_steps_with_logprobs_overlap_too(tiny_model):
    params = [SamplingParams(max_tokens=10, temperature=0.7, seed=i, ignore_eos=True, logprobs=i % 3)
              for i in range(len(PROMPTS))]
    _, want = _run(tiny_model, False, params, None)
    want_logprobs = _run.logprobs
    llm, got = _run(tiny_model, True, params, None)
    assert got == want
    _assert_logprobs_close(_run.logprobs, want_logprobs)
    assert llm.engine.num_overlapped_steps >= 8  # every decode step, although each row asks for logprobs


def test_penalized_steps_overlap_and_count_the_token_in_flight(tiny_model):
    """Penalties read every output token, the newest one still in flight on the device (added there); a
    prompt-logprobs request joining mid-run makes some steps synchronous while penalized sequences have a
    token in flight (that path counts it the same way)."""
    params = []
    for i in range(len(PROMPTS)):
        kw = dict(max_tokens=14, ignore_eos=True)
        if i % 3 == 0:
            kw.update(temperature=0, frequency_penalty=-2.0, presence_penalty=0.5)  # < 0: repeats pay
        elif i % 3 == 1:
            kw.update(temperature=0.9, seed=i, repetition_penalty=1.8)
        else:
            kw.update(temperature=0, prompt_logprobs=1 if i == 5 else None)
        params.append(SamplingParams(**kw))

    want, got = _synchronous_and_overlapped(tiny_model, params)
    assert got == want
    # the penalties had an effect: greedy with frequency penalty differs from plain greedy
    plain = LLM(tiny_model["model_dir"], dtype="float32").generate(
        [{"prompt_token_ids": PROMPTS[0]}], SamplingParams(max_tokens=14, temperature=0, ignore_eos=True))
    assert plain[0].outputs[0].token_ids != want[0]


def test_token_restrictions_overlap_and_read_the_token_in_flight(tiny_model):
    """allowed_token_ids, logit_bias and bad_words give the synchronous engine's tokens with overlapped steps. A
    bad word whose prefix ends in the newest output token is decided on the device while that token is in flight
    (in overlapped and in synchronous steps), so these requests do not make the shared batch's steps synchronous."""
    probe_llm = LLM(tiny_model["model_dir"], dtype="float32")
    tok = probe_llm.get_tokenizer()
    probe = [o.outputs[0].token_ids for o in probe_llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))]
    params, words = [], {}
    for i, out in enumerate(probe):
        # 1 and 2 end early: 4 and 5 join while 0 and 3 still decode
        kw = dict(max_tokens=6 + 2 * i if i in (1, 2) else 16, ignore_eos=True)
        if i % 3 == 0:  # a word this prompt's greedy output contains, so the ban changes the output
            words[i] = two_token_word(tok, [out])
            kw.update(temperature=0, bad_words=[words[i][0]])
        elif i % 3 == 1:
            kw.update(temperature=0.9, seed=i, allowed_token_ids=sorted(set(probe[i - 1][:6])), logit_bias={5: 2.0})
        else:  # and prompt logprobs: its first step, mid-run, is synchronous while the others' tokens are in flight
            kw.update(temperature=0, logit_bias={out[2]: -100, 300: 4.0}, prompt_logprobs=1 if i == 5 else None)
        params.append(SamplingParams(**kw))

    want, got = _synchronous_and_overlapped(tiny_model, params)
    assert got == want
    for i, (word, ids) in words.items():
        assert ids in encode_bad_words(tok, word) and got[i] != probe[i]
        assert not any(got[i][k:k + 2] == ids for k in range(len(got[i]) - 1))
    for i in range(1, len(PROMPTS), 3):
        assert set(got[i]) <= set(params[i].allowed_token_ids)
    for i in range(2, len(PROMPTS), 3):
        assert got[i] != probe[i]  # the biases changed the greedy output


def _synchronous_and_overlapped(tiny_model, params) -> tuple[list, list]:
    """PROMPTS' output tokens with synchronous steps, then with overlapped steps (which must have overlapped)."""
    outputs = []
    for async_on in (False, True):
        llm = LLM(tiny_model["model_dir"], dtype="float32", max_num_seqs=4, async_scheduling=async_on)
        outputs.append([o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                                                                      params)])
    assert llm.engine.num_overlapped_steps >= 10
    return outputs[0], outputs[1]


def test_device_wait_counts_the_sampled_tokens_and_the_input_copies_of_the_step_before(tiny_model):
    """``device_wait_seconds`` (the bench's waiting columns, /metrics) is every host wait on the device in a step:
    the sampled tokens, and the input builder's wait for the previous step's copies to leave its pinned buffers
    (on CUDA they queue behind the step before; on the CPU there is no such wait)."""
    llm, _ = _run(tiny_model, True, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), None)
    engine = llm.engine
    inputs = engine.runner.inputs
    assert inputs.copy_wait_seconds == 0.0  # the CPU records no copy events
    tokens = engine.device_wait_seconds
    assert tokens == engine._token_wait_seconds >= 0.0
    inputs.copy_wait_seconds = 0.25  # as if prepare() had blocked that long on CUDA
    assert engine.device_wait_seconds == pytest.approx(tokens + 0.25)
    assert engine.get_stats().device_wait_seconds == pytest.approx(tokens + 0.25)
