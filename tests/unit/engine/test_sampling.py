"""Sampling: n>1 forks sharing prompt blocks, per-request seeds independent of the batch, and each
sampling knob's effect on the distribution."""

from __future__ import annotations

import pytest
import torch

from loraplex import LLM, SamplingParams
from loraplex.engine.sampler import Sampler, SampleRow


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(tiny_model["model_dir"], dtype="float32", seed=123)


PROMPT = {"prompt_token_ids": [1] + list(range(40, 80))}  # 41 tokens: 2 full blocks + 9 in a third


def test_n4_samples_share_prompt_blocks_until_they_diverge(llm):
    engine = llm.engine
    engine.add_request("n4", PROMPT["prompt_token_ids"], SamplingParams(n=4, max_tokens=20, temperature=1.0,
                                                                        seed=7, ignore_eos=True))
    engine.step()  # the whole prompt, then 4 samples forked from its last position
    samples = engine.scheduler.samples["n4"]
    assert len(samples) == 4 and len({tuple(s.block_ids) for s in samples}) == 1
    bm = engine.block_manager
    assert [bm.blocks[b].ref_count for b in samples[0].block_ids] == [4, 4, 4]
    engine.step()  # each sample writes into the shared partial block: 3 copies, the full blocks stay shared
    assert bm.num_cow_copies == 3
    assert len({s.block_ids[2] for s in samples}) == 4
    assert all(s.block_ids[:2] == samples[0].block_ids[:2] for s in samples)
    while engine.has_unfinished_requests():
        engine.step()
    assert len({tuple(s.output_token_ids) for s in samples}) == 4  # they diverged
    assert bm.num_free_blocks == bm.num_blocks


def test_seed_gives_same_tokens_whatever_the_batch(llm):
    seeded = SamplingParams(n=2, max_tokens=16, temperature=0.9, top_p=0.95, seed=42, ignore_eos=True)
    alone = llm.generate(PROMPT, seeded)[0]
    noise = SamplingParams(max_tokens=24, temperature=1.0, ignore_eos=True)
    crowd = [{"prompt_token_ids": [1] + list(range(100 + i, 130 + 2 * i))} for i in range(5)]
    mixed = llm.generate(crowd[:2] + [PROMPT] + crowd[2:], [noise, noise, seeded, noise, noise, noise])[2]
    assert [c.token_ids for c in mixed.outputs] == [c.token_ids for c in alone.outputs]
    assert alone.outputs[0].token_ids != alone.outputs[1].token_ids
    other_seed = llm.generate(PROMPT, SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=43,
                                                     ignore_eos=True))[0]
    assert other_seed.outputs[0].token_ids != alone.outputs[0].token_ids


def _rows(params: SamplingParams, num: int, output=(), prompt=(1,)) -> list[SampleRow]:
    return [SampleRow(params, i, len(output), list(prompt), list(output)) for i in range(num)]


def _draw(logits_row: torch.Tensor, params: SamplingParams, num=2000, **kw) -> torch.Tensor:
    logits = logits_row.repeat(num, 1)
    return Sampler(torch.device("cpu"), seed=0)(logits, _rows(params, num, **kw)).token_ids


LOGITS = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.07, 0.03]))


def test_temperature_sampling_follows_the_distribution():
    counts = torch.bincount(_draw(LOGITS, SamplingParams(temperature=1.0, seed=None)), minlength=5).float() / 2000
    assert torch.allclose(counts, LOGITS.exp(), atol=0.04)


def test_top_k_top_p_min_p_restrict_the_support():
    assert set(_draw(LOGITS, SamplingParams(temperature=1.0, top_k=2)).tolist()) == {0, 1}
    assert set(_draw(LOGITS, SamplingParams(temperature=1.0, top_p=0.65)).tolist()) == {0, 1}
    assert set(_draw(LOGITS, SamplingParams(temperature=1.0, min_p=0.4)).tolist()) == {0, 1, 2}
    assert set(_draw(LOGITS, SamplingParams(temperature=1.0, top_k=1)).tolist()) == {0}


def test_penalties_move_greedy_choice_away_from_seen_tokens():
    logits = torch.tensor([[2.0, 1.9, 0.5, 0.1]])
    s = Sampler(torch.device("cpu"))
    greedy = SamplingParams(temperature=0)
    assert s(logits, _rows(greedy, 1)).token_ids.item() == 0
    rep = SamplingParams(temperature=0, repetition_penalty=1.2)
    assert s(logits, _rows(rep, 1, prompt=[0])).token_ids.item() == 1  # 2.0/1.2 < 1.9
    pres = SamplingParams(temperature=0, presence_penalty=0.2)
    assert s(logits, _rows(pres, 1, output=[0])).token_ids.item() == 1
    freq = SamplingParams(temperature=0, frequency_penalty=0.06)
    assert s(logits, _rows(freq, 1, output=[0])).token_ids.item() == 0  # one occurrence: 1.94 > 1.9
    assert s(logits, _rows(freq, 1, output=[0, 0])).token_ids.item() == 1  # two: 1.88 < 1.9
    # a mixed batch: only the penalized row moves
    both = s(logits.repeat(2, 1), [SampleRow(greedy, 0, 1, [1], [0]), SampleRow(pres, 0, 1, [1], [0])])
    assert both.token_ids.tolist() == [0, 1]
    # logprobs report the raw distribution, before penalties
    out = s(logits, _rows(SamplingParams(temperature=0, presence_penalty=0.2, logprobs=2), 1, output=[0]))
    assert out.logprobs.item() == pytest.approx(torch.log_softmax(logits, -1)[0, 1].item())
    assert out.ranks.item() == 2


def test_feature_flags_pick_the_path_and_every_path_reports_raw_logprobs():
    """The greedy-only fast path (no per-row work) and the general path agree on tokens and logprobs;
    a batch mixing greedy and random rows samples only the random ones."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 50, generator=gen) * 3
    raw = torch.log_softmax(logits, -1)
    s = Sampler(torch.device("cpu"))
    fast = s(logits, _rows(SamplingParams(temperature=0), 6))
    general = s(logits, _rows(SamplingParams(temperature=0, logprobs=0), 6))
    assert fast.ranks is None and general.ranks.tolist() == [1] * 6
    assert fast.token_ids.tolist() == general.token_ids.tolist() == logits.argmax(-1).tolist()
    assert torch.allclose(fast.logprobs, raw.max(-1).values, atol=1e-6)
    assert torch.allclose(general.logprobs, raw.max(-1).values, atol=1e-6)
    assert SamplingParams(temperature=0).sampler_flags == 0
    mixed = s(logits, [SampleRow(SamplingParams(temperature=0), 0, 0, [1], []) if i % 2 else
                       SampleRow(SamplingParams(temperature=50.0), 0, 0, [1], []) for i in range(6)])
    greedy_rows = mixed.token_ids[1::2].tolist()
    assert greedy_rows == logits[1::2].argmax(-1).tolist()
    assert torch.allclose(mixed.logprobs, raw.gather(1, mixed.token_ids[:, None]).squeeze(1), atol=1e-6)


def test_repetition_penalty_through_the_engine_matches_hf(llm, hf_llama):
    """The step sampler's cached prompt arrays and the one-scatter token counts give Hugging Face's
    greedy tokens under a repetition penalty (prompt and output tokens), next to unpenalized requests."""
    prompt = [1] + [40 + (i * 7) % 23 for i in range(30)]  # repeated tokens in the prompt
    penalized = SamplingParams(max_tokens=12, temperature=0, repetition_penalty=1.5, ignore_eos=True)
    plain = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": prompt}, {"prompt_token_ids": prompt}], [plain, penalized])
    ids = torch.tensor([prompt])
    saved = hf_llama.generation_config.eos_token_id
    hf_llama.generation_config.eos_token_id = None  # like ignore_eos (see conftest.hf_greedy)
    try:
        with torch.no_grad():
            want = hf_llama.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                                     do_sample=False, repetition_penalty=1.5,
                                     pad_token_id=hf_llama.config.pad_token_id)[0, len(prompt):].tolist()
    finally:
        hf_llama.generation_config.eos_token_id = saved
    assert len(want) == 12
    assert outs[1].outputs[0].token_ids == want
    assert outs[0].outputs[0].token_ids != want  # the penalty changed something


def test_step_sampler_gathers_rows_as_a_view_only_when_they_are_the_first_n():
    import numpy as np

    from loraplex.engine.step_sampler import StepSampler

    ss = StepSampler(lambda h: h, Sampler(torch.device("cpu")), torch.device("cpu"), max_rows=8)
    hidden = torch.arange(40.0).view(5, 8)
    view = ss._gather_rows(hidden, np.arange(3))
    assert view.data_ptr() == hidden.data_ptr() and torch.equal(view, hidden[:3])
    # first row 0 and last row n-1, but not 0..n-1: sampled rows then a prompt-logprob row
    for rows in ([0, 3, 2], [0, 0, 2], [1, 2], [4], [0, 2, 1, 3]):
        got = ss._gather_rows(hidden, np.asarray(rows, dtype=np.int64))
        assert torch.equal(got, hidden[rows]), rows


def test_logprob_entries_carry_each_tokens_own_text_decoded_once_per_id(llm):
    """Each logprob entry names its token by the token decoded alone; the text comes from a per-id cache."""
    engine = llm.engine
    decode = engine.tokenizer.decode
    engine._token_texts.clear()
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=2, ignore_eos=True)
    prompt = {"prompt_token_ids": [1, 5, 9, 12]}
    first = llm.generate([prompt], params)[0].outputs[0]
    seen = set()
    for token_id, entry in zip(first.token_ids, first.logprobs, strict=True):
        assert token_id in entry and all(lp.decoded_token == decode([t]) for t, lp in entry.items())
        seen |= set(entry)
    assert set(engine._token_texts) == seen
    # the cache is what answers: a marked entry comes back as marked, no tokenizer call in between
    marked = first.token_ids[0]
    engine._token_texts[marked] = "<cached>"
    try:
        again = llm.generate([prompt], params)[0].outputs[0]
    finally:
        engine._token_texts.clear()
    assert again.token_ids == first.token_ids and again.logprobs[0][marked].decoded_token == "<cached>"


def test_a_snapshot_is_a_validated_read_only_copy_shared_by_the_requests_of_one_object():
    """What the engine runs (and caches its sampler flags and bias arrays on): a caller's later change to its own
    object never reaches it, and a snapshot passed on again is not copied again."""
    from loraplex.engine.sampling_params import SamplingParamsError, snapshots

    params = SamplingParams(temperature=0.5, stop=["x"], logit_bias={"5": 1.0})
    snap = params.snapshot()
    assert snap == params and snap is not params and snap.snapshot() is snap
    params.temperature = 0.0
    params.stop.append("y")
    params.logit_bias[6] = 2.0
    assert (snap.temperature, snap.stop, snap.logit_bias) == (0.5, ["x"], {5: 1.0})
    with pytest.raises(AttributeError, match="^temperature: "):
        snap.temperature = 1.0
    params.top_p = 2.0
    with pytest.raises(SamplingParamsError, match="^top_p: "):
        params.snapshot()
    a, b = SamplingParams(), SamplingParams()
    got = snapshots([a, b, a, snap])
    assert got[0] is got[2] and got[1] is not got[0] and got[3] is snap and got[0] == a
