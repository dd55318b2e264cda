"""Speculative decoding with prompt-lookup (n-gram) drafts: the proposer, the verification rule (greedy: the
argmax run; random: exact output distribution), and the engine on the CPU against itself without drafts
(greedy tokens equal, with adapters, prefix caching and preemption), with stats and limits."""

from __future__ import annotations

import random

import pytest
import torch

from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.engine.config import EngineConfig
from loraplex.engine.spec_decode import NgramProposer, can_speculate, verify
from tests.conftest import adapter_dir


# ---- the proposer ---------------------------------------------------------------------------------------------
def test_proposer_continues_the_latest_occurrence_of_the_longest_tail():
    p = NgramProposer(3, min_n=1, max_n=3)
    #           0  1  2  3  4  5  6  7  8  9 10
    ctx = [5, 6, 7, 8, 9, 6, 7, 1, 2, 6, 7]
    # tail (6, 7) occurs at 1 and 5 (the tail 3-gram (2, 6, 7) never before): the latest, 5, continues 1, 2, 6
    assert p.propose(ctx) == [1, 2, 6]
    assert p.propose(ctx, max_tokens=2) == [1, 2]
    assert p.propose([5, 6, 7, 8, 5, 6, 7]) == [8, 5, 6]  # the 3-gram wins over shorter ones
    assert p.propose([1, 2, 3, 4]) == []  # nothing repeats
    assert p.propose([4, 4]) == [4]  # a continuation may run up to the tail itself
    assert NgramProposer(3, min_n=2, max_n=3).propose([1, 2, 9, 2]) == []  # a 1-gram is below min_n


def test_proposer_looks_back_only_within_its_window():
    ctx = [1, 2, 3] + list(range(100, 200)) + [1, 2]
    assert NgramProposer(2, 2, 2).propose(ctx) == [3, 100]
    assert NgramProposer(2, 2, 2, window=50).propose(ctx) == []


def test_proposer_keeps_each_sequences_context_incrementally():
    """Keyed by sequence, the context array grows by each step's new tokens: the same drafts as from scratch at
    every length, and a context whose tokens changed (a new sequence under a reused key) is rebuilt."""
    rng = random.Random(3)
    seq = [rng.randrange(6) for _ in range(300)]
    keyed, fresh = NgramProposer(4, 1, 3, window=64), NgramProposer(4, 1, 3, window=64)
    for n in range(2, 300, 3):
        assert keyed.propose(seq[:n], key=7) == fresh.propose(seq[:n]), n
    other = [5 - t for t in seq[:100]]
    assert keyed.propose(other, key=7) == fresh.propose(other)
    keyed.forget(7)
    assert keyed._contexts == {}


def test_proposer_and_config_limits():
    with pytest.raises(ValueError, match="num_speculative_tokens must be >= 1"):
        NgramProposer(0)
    with pytest.raises(ValueError, match="prompt_lookup_min must be >= 1 and <= prompt_lookup_max, got 3 and 2"):
        EngineConfig(num_speculative_tokens=2, prompt_lookup_min=3, prompt_lookup_max=2)
    with pytest.raises(ValueError, match="num_speculative_tokens must be >= 0, got -1"):
        EngineConfig(num_speculative_tokens=-1)
    with pytest.raises(ValueError, match="speculative_method must be one of ngram, got 'eagle'"):
        EngineConfig(num_speculative_tokens=2, speculative_method="eagle")


def test_which_requests_may_speculate():
    assert can_speculate(SamplingParams(temperature=0))
    assert can_speculate(SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05))
    for params in (SamplingParams(temperature=0.8, seed=3), SamplingParams(temperature=0, logprobs=2),
                   SamplingParams(temperature=0, repetition_penalty=1.2), SamplingParams(temperature=0.7, n=2),
                   SamplingParams(temperature=0, min_tokens=3), SamplingParams(temperature=0, logit_bias={5: 1.0})):
        assert not can_speculate(params), params


# ---- verification ---------------------------------------------------------------------------------------------
def _logits(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def test_greedy_verification_keeps_the_argmax_run():
    gen = torch.Generator().manual_seed(0)
    greedy = SamplingParams(temperature=0)
    # sequence 0: argmaxes 2, 3, 1, 0 against draft [2, 3, 4]: two accepted, then the model's 1
    # sequence 1: argmaxes 4, 4 against draft [4]: all accepted, then the bonus 4
    # sequence 2: argmax 0 against draft [1]: none accepted
    rows = [[0, 0, 9, 0, 0], [0, 0, 0, 9, 0], [0, 9, 0, 0, 0], [9, 0, 0, 0, 0],
            [0, 0, 0, 0, 9], [0, 0, 0, 0, 9],
            [9, 0, 0, 0, 0], [0, 0, 0, 9, 0]]
    out = verify(_logits(rows), [[2, 3, 4], [4], [1]], [greedy] * 3, gen)
    assert out.token_ids == [[2, 3, 1], [4, 4], [0]]
    lp = torch.log_softmax(_logits(rows), -1)
    assert out.logprobs[0] == pytest.approx([lp[0, 2].item(), lp[1, 3].item(), lp[2, 1].item()])
    assert out.logprobs[2] == pytest.approx([lp[6, 0].item()])


@pytest.mark.parametrize("kw", [{}, {"top_k": 3}, {"top_p": 0.7}, {"min_p": 0.2}])
def test_random_verification_keeps_the_sampling_distribution(kw):
    """One draft token per sequence, 40,000 sequences on the same logits: the first emitted token follows the
    processed distribution p exactly (accepted with p(d), else drawn from p without d), whatever the draft; the
    second, after an accepted draft, follows the next position's p. A rule that trusted the draft would put far
    more mass on it."""
    gen = torch.Generator().manual_seed(1)
    params = SamplingParams(temperature=0.9, **kw)
    first = torch.tensor([2.0, 1.0, 0.5, -1.0, 0.0])
    second = torch.tensor([0.0, 0.0, 3.0, 0.0, 1.0])
    n = 40_000
    logits = torch.stack([first, second]).repeat(n, 1)
    drafts = [[3]] * (n // 2) + [[0]] * (n // 2)  # an unlikely draft, and the likeliest one
    out = verify(logits, drafts, [params] * n, gen)

    def expected(row: torch.Tensor) -> torch.Tensor:
        from loraplex.engine.sampling_params import SAMPLE_MIN_P, SAMPLE_RANDOM, SAMPLE_TOP_K_P
        from loraplex.engine.spec_decode import _processed_probs

        flags = SAMPLE_RANDOM | (SAMPLE_TOP_K_P if "top_k" in kw or "top_p" in kw else 0) | (
            SAMPLE_MIN_P if "min_p" in kw else 0)
        return _processed_probs(row[None], [params], flags, row.device)[0]

    p1, p2 = expected(first), expected(second)
    for half in (slice(0, n // 2), slice(n // 2, n)):
        toks = torch.tensor([t[0] for t in out.token_ids[half]])
        freq = torch.bincount(toks, minlength=5).float() / toks.numel()
        assert torch.allclose(freq, p1, atol=0.012), (freq, p1)
    seconds = torch.tensor([t[1] for t in out.token_ids if len(t) == 2 and t[0] == 0])  # after an accepted 0
    freq2 = torch.bincount(seconds, minlength=5).float() / seconds.numel()
    assert seconds.numel() > 3000 and torch.allclose(freq2, p2, atol=0.02), (freq2, p2)
    assert all(len(t) == 1 for t, d in zip(out.token_ids, drafts) if t[0] != d[0])


# ---- the engine -----------------------------------------------------------------------------------------------
def _prompts(seed: int) -> list[list[int]]:
    """Prompts that repeat themselves (lookup finds drafts at once) and plain random ones."""
    rng = random.Random(seed)
    out = []
    for n in (6, 11, 23):
        piece = [rng.randrange(8, 500) for _ in range(n)]
        out.append([1] + piece * 3)
    out += [[1] + [rng.randrange(8, 500) for _ in range(n)] for n in (5, 40)]
    return out


def _run(llm: LLM, prompts, params, loras=None):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=loras)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def engines(tiny_model):
    kw = dict(dtype="float32", enable_lora=True, max_loras=3, max_num_batched_tokens=64, seed=2)
    return LLM(tiny_model["model_dir"], **kw), LLM(tiny_model["model_dir"], num_speculative_tokens=4, **kw)


def test_greedy_tokens_equal_the_engine_without_drafts(tiny_model, engines):
    plain, spec = engines
    prompts = _prompts(4)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (40, 33, 17, 40, 9)]
    loras = [None, LoRARequest("a0", 1, adapter_dir(tiny_model, 0)), LoRARequest("a3", 4, adapter_dir(tiny_model, 3)),
             LoRARequest("a0", 1, adapter_dir(tiny_model, 0)), None]
    sched = spec.engine.scheduler
    drafted, accepted = sched.num_draft_tokens, sched.num_accepted_tokens
    want = _run(plain, prompts, params, loras)
    got = _run(spec, prompts, params, loras)
    assert got == want
    assert [len(t) for t in got] == [40, 33, 17, 40, 9]
    assert sched.num_draft_tokens > drafted and sched.num_accepted_tokens > accepted
    assert sched.num_accepted_tokens - accepted < sched.num_draft_tokens - drafted  # some were rejected too
    stats = spec.engine.get_stats()
    assert stats.spec_draft_tokens == sched.num_draft_tokens and stats.spec_accepted_tokens == sched.num_accepted_tokens
    assert spec.engine.counters["spec_accepted_tokens"] == sched.num_accepted_tokens
    assert not spec.engine.async_scheduling


def test_stops_inside_an_accepted_draft_and_prefix_cache_reuse(tiny_model, engines):
    """A stop token or max_tokens reached in the middle of accepted draft tokens ends the sequence there; a second
    run of the same prompts (cached prefix blocks, written by speculating steps) gives the same tokens."""
    plain, spec = engines
    prompts = _prompts(9)[:3]
    free = _run(plain, prompts, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    stop = [t[12] for t in free]  # a token each sequence generates, used as its stop token
    params = [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop_token_ids=[s]) for s in stop]
    want = _run(plain, prompts, params)
    for _ in range(2):
        assert _run(spec, prompts, params) == want
    assert all(len(w) <= 13 and w[-1] == s for w, s in zip(want, stop))
    for n in (1, 2, 7):
        p = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        assert _run(spec, prompts, p) == [t[:n] for t in free]


def test_requests_that_cannot_speculate_decode_one_token_per_step(engines):
    plain, spec = engines
    prompts = _prompts(5)[:3]
    sched = spec.engine.scheduler
    drafted = sched.num_draft_tokens
    for params in (SamplingParams(max_tokens=12, temperature=0, repetition_penalty=1.3, ignore_eos=True),
                   SamplingParams(max_tokens=12, temperature=0.8, seed=11, ignore_eos=True),
                   SamplingParams(max_tokens=12, temperature=0, logprobs=2, ignore_eos=True)):
        assert _run(spec, prompts, params) == _run(plain, prompts, params)
    assert sched.num_draft_tokens == drafted


def test_random_sampling_with_drafts_runs_to_its_lengths(engines):
    _, spec = engines
    prompts = _prompts(6)
    sched = spec.engine.scheduler
    drafted = sched.num_draft_tokens
    params = SamplingParams(max_tokens=25, temperature=0.7, top_k=20, ignore_eos=True)
    got = _run(spec, prompts, params)
    assert [len(t) for t in got] == [25] * len(prompts)
    assert sched.num_draft_tokens > drafted


def test_preemption_with_drafts_keeps_greedy_tokens(tiny_model):
    """A KV cache too small for every sequence at once: sequences are preempted and recomputed while others
    speculate; blocks taken for rejected drafts go back to the pool."""
    kw = dict(dtype="float32", num_kv_blocks=14, block_size=8, max_num_batched_tokens=64, seed=2)
    prompts = _prompts(7)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    want = _run(LLM(tiny_model["model_dir"], **kw), prompts, params)
    spec = LLM(tiny_model["model_dir"], speculative_config={"method": "ngram", "num_speculative_tokens": 5,
                                                             "prompt_lookup_max": 3, "prompt_lookup_min": 1}, **kw)
    assert _run(spec, prompts, params) == want
    engine = spec.engine
    assert engine.scheduler.num_preemptions > 0 and engine.scheduler.num_draft_tokens > 0
    assert engine.block_manager.num_used_blocks == 0 or not engine.scheduler.running


def test_speculative_config_names_bad_keys(tiny_model):
    with pytest.raises(ValueError, match="unknown key\\(s\\) draft_model"):
        LLM(tiny_model["model_dir"], speculative_config={"num_speculative_tokens": 2, "draft_model": "x"})
    with pytest.raises(ValueError, match="num_speculative_tokens is required"):
        LLM(tiny_model["model_dir"], speculative_config={"method": "ngram"})


# ---- the scheduler's bookkeeping, model-free --------------------------------------------------------------------
def _spec_run(sched, model, max_steps=10_000):
    """Steps with a model that is a function of the context: a draft is checked token by token against it, as the
    greedy verification does. Returns outputs and the number of steps."""
    from loraplex.engine.scheduler_output import ModelRunnerOutput

    outputs, steps = {}, 0
    bs = sched.block_manager.block_size
    while sched.has_unfinished_requests():
        steps += 1
        assert steps < max_steps
        out = sched.schedule()
        result = ModelRunnerOutput()
        for s in out.scheduled:
            req = s.request
            # the runner may only touch slots the block table covers
            assert len(req.block_ids) * bs >= req.num_computed_tokens + s.num_new_tokens
            if s.draft_token_ids:
                ctx, toks = list(req.token_ids), []
                for d in s.draft_token_ids:
                    t = model(ctx)
                    toks.append(t)
                    if t != d:
                        break
                    ctx.append(d)
                else:
                    toks.append(model(ctx))
                result.sampled_token_ids[req.seq_id] = toks
            elif s.num_samples:
                result.sampled_token_ids[req.seq_id] = [model(req.token_ids)]
        for req in sched.update_from_output(out, result):
            if req.is_finished:
                outputs[req.request_id] = req.output_token_ids
    return outputs, steps


def _expected(model, prompt, n):
    ids = list(prompt)
    for _ in range(n):
        ids.append(model(ids))
    return ids[len(prompt):]


def test_scheduler_emits_whole_accepted_drafts_and_frees_their_blocks():
    """A model that repeats the context with period 5: prompt lookup predicts it exactly, so each step emits a
    draft of 4 and the model's own token (about a fifth of the steps); blocks taken for drafts are trimmed or
    freed with the sequence."""
    from tests.unit.engine.fakes import make_request, make_scheduler

    def periodic(ids):
        return ids[-5]

    sched = make_scheduler(num_blocks=64, block_size=4, num_speculative_tokens=4, prompt_lookup_min=2)
    prompts = {str(i): [10 * i + j for j in range(5)] * 2 for i in range(3)}
    for rid, prompt in prompts.items():
        sched.add_request(make_request(rid, prompt, max_tokens=41))
    outputs, steps = _spec_run(sched, periodic)
    assert outputs == {rid: _expected(periodic, p, 41) for rid, p in prompts.items()}
    assert steps <= 1 + 41 // 5 + 2
    assert sched.num_accepted_tokens == sched.num_draft_tokens > 0
    assert sched.block_manager.num_used_blocks == 0


def test_scheduler_with_rejected_drafts_and_preemption_keeps_the_tokens():
    """A model drafts mostly miss (prompt lookup on a context that repeats only now and then), a KV cache that
    forces preemption, stop tokens and max_tokens inside drafts: the same tokens as one-by-one decoding."""
    from tests.unit.engine.fakes import make_request, make_scheduler, next_token

    def model(ids):
        return next_token(ids, 0) % 7 if len(ids) % 3 else ids[-4]

    sched = make_scheduler(num_blocks=12, block_size=4, num_speculative_tokens=3, prompt_lookup_min=1,
                           max_num_batched_tokens=24)
    prompts = {str(i): [1 + i, 2, 3, 1 + i, 2, 3, 4] for i in range(5)}
    for rid, prompt in prompts.items():
        sched.add_request(make_request(rid, prompt, max_tokens=20 + int(rid)))
    outputs, _ = _spec_run(sched, model)
    assert outputs == {rid: _expected(model, p, 20 + int(rid)) for rid, p in prompts.items()}
    assert sched.num_preemptions > 0 and 0 < sched.num_accepted_tokens < sched.num_draft_tokens
    assert sched.block_manager.num_used_blocks == 0


def test_prometheus_exposes_the_speculation_counters():
    from prometheus_client import CollectorRegistry, generate_latest

    from loraplex.engine.protocol import EngineStats
    from loraplex.platform.metrics import _EngineCollector

    registry = CollectorRegistry()
    registry.register(_EngineCollector(lambda: "m", lambda: EngineStats(spec_draft_tokens=7, spec_accepted_tokens=3), 4))
    text = generate_latest(registry).decode()
    assert 'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 7.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 3.0' in text


def test_server_settings_reach_the_engine(tmp_path):
    from loraplex.platform.engine_boot import engine_config
    from loraplex.settings import Settings

    settings = Settings(data_dir=str(tmp_path), num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=5)
    cfg = engine_config(settings, tmp_path, "m")
    assert (cfg.num_speculative_tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (3, 1, 5)


async def test_async_engine_streams_several_tokens_per_delta_with_drafts(tiny_model):
    """Through the server's engine (AsyncEngine): a speculating request's deltas may carry several tokens; the
    stream's tokens and text are the offline API's, and so is the token count of the final delta."""
    from loraplex.engine.async_engine import AsyncEngine
    from loraplex.engine.protocol import EngineRequest

    eng = AsyncEngine.from_config(EngineConfig(model=tiny_model["model_dir"], dtype="float32",
                                               num_speculative_tokens=4, prompt_lookup_min=1))
    try:
        params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
        prompts = _prompts(11)[:3]
        streams = []
        for i, p in enumerate(prompts):
            streams.append([d async for d in eng.generate(EngineRequest(f"r{i}", p, params))])
    finally:
        await eng.shutdown()
    offline = LLM(tiny_model["model_dir"], dtype="float32").generate([{"prompt_token_ids": p} for p in prompts],
                                                                      params)
    for deltas, want in zip(streams, offline):
        assert sum((d.token_ids for d in deltas), []) == want.outputs[0].token_ids
        assert "".join(d.text for d in deltas) == want.outputs[0].text
        assert deltas[-1].finished and deltas[-1].num_generated_tokens == 30
    assert any(len(d.token_ids) > 1 for deltas in streams for d in deltas)


def test_blocks_filled_by_accepted_drafts_are_cached_under_their_tokens():
    """Prefix caching registers a block once its tokens are computed; with drafts a step completes several tokens
    at once, and the blocks they fill must be keyed by those tokens: a later prompt that repeats the first request's
    prompt and output finds every full block in the cache."""
    from tests.unit.engine.fakes import make_request, make_scheduler

    def periodic(ids):
        return ids[-5]

    sched = make_scheduler(num_blocks=64, block_size=4, num_speculative_tokens=4, prompt_lookup_min=2)
    prompt = [11, 12, 13, 14, 15] * 2
    sched.add_request(make_request("a", prompt, max_tokens=21))
    outputs, _ = _spec_run(sched, periodic)
    assert sched.num_accepted_tokens > 8
    again = make_request("b", prompt + outputs["a"][:20], max_tokens=1)  # 30 tokens: 28 of them in 7 full blocks
    sched.add_request(again)
    _spec_run(sched, periodic)
    assert again.num_cached_tokens == 28


def test_drafts_stop_at_max_model_len_and_max_tokens():
    """Drafts never run past the model length or the request's max_tokens: the sequence ends exactly there, with the
    tokens one-by-one decoding gives, and no block beyond the model length is ever taken."""
    from tests.unit.engine.fakes import make_request, make_scheduler

    def periodic(ids):
        return ids[-5]

    for max_len, max_tokens in ((23, None), (64, 13), (64, 1)):
        sched = make_scheduler(num_blocks=64, block_size=4, num_speculative_tokens=6, prompt_lookup_min=2,
                               max_model_len=max_len)
        prompt = [21, 22, 23, 24, 25] * 2
        req = make_request("a", prompt, params=SamplingParams(max_tokens=max_tokens, temperature=0,
                                                              ignore_eos=True))
        sched.add_request(req)
        blocks_seen = []
        orig = sched.block_manager.allocate_slots

        def spy(r, n, cached=(), orig=orig, seen=blocks_seen):
            ok = orig(r, n, cached)
            seen.append(len(r.block_ids))
            return ok

        sched.block_manager.allocate_slots = spy
        outputs, _ = _spec_run(sched, periodic)
        n = max_len - len(prompt) if max_tokens is None else max_tokens
        assert outputs["a"] == _expected(periodic, prompt, n)
        assert max(blocks_seen) <= -(-max_len // 4)


def test_console_shows_the_acceptance_rate_once_drafts_ran():
    from loraplex.platform.console.pages_overview import EngineView
    from loraplex.platform.console.render import render

    quiet = render("_engine.html", engine=EngineView("running", max_loras=4))
    assert "spec-accepted" not in quiet
    busy = render("_engine.html", engine=EngineView("running", max_loras=4, spec_draft_tokens=2000,
                                                     spec_accepted_tokens=750))
    assert "draft tokens accepted 38% of 2,000" in busy
