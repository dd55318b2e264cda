"""Penalty counts kept per sequence across steps (``engine/penalty_state.py``) against counting whole token lists."""

from __future__ import annotations

import random

import pytest
import torch

from loraplex.engine.penalty_state import PenaltyState, token_counts
from loraplex.engine.sampler import Sampler, SampleRow
from loraplex.engine.sampling_params import SamplingParams

VOCAB = 50


def _reference(prompts, outputs, inflight_src, inflight_tokens):
    """Counts of the whole lists, the placeholder's token read from ``inflight_tokens``."""
    known = [o[:-1] if s is not None else o for o, s in zip(outputs, inflight_src)]
    counts = token_counts(known, VOCAB, "cpu")
    for j, s in enumerate(inflight_src):
        if s is not None:
            counts[j, int(inflight_tokens[s])] += 1
    return counts, token_counts(prompts, VOCAB, "cpu") > 0


@pytest.mark.parametrize("seed", range(6))
def test_rows_kept_across_steps_equal_counting_the_whole_lists(seed):
    """300 steps over a changing population: sequences start and finish, skip steps (prefill chunks, preemption),
    append one to three tokens (speculation), have their newest token in flight (overlapped steps; the host writes
    the same token in later), fork (a new sample index), and once in a while come back shorter (rebuilt). Few
    rows to start with, so rows are freed from absent keys and the buffers grow."""
    rng = random.Random(seed)
    state = PenaltyState(VOCAB, "cpu", min_rows=2)
    live: dict[tuple[int, int], dict] = {}
    next_seq = 0
    forks: dict[int, int] = {}
    for _ in range(300):
        while len(live) < rng.randint(1, 12):
            live[(next_seq, 0)] = {"prompt": [rng.randrange(VOCAB) for _ in range(rng.randint(0, 9))],
                                   "out": [], "pending": None}
            next_seq += 1
        if rng.random() < 0.1:  # a fork: a new sample of a live sequence, same tokens so far
            (seq, _), parent = rng.choice(list(live.items()))
            index = forks[seq] = forks.get(seq, 0) + 1  # keys never come back (seq_ids are never reused)
            out = list(parent["out"])
            if parent["pending"] is not None:
                out[-1] = parent["pending"]  # the child starts from the tokens as the host will know them
            live[(seq, index)] = {"prompt": parent["prompt"], "out": out, "pending": None}
        for key in [k for k in live if rng.random() < 0.05]:
            del live[key]  # finished
        if not live:
            continue
        step = [k for k in live if rng.random() < 0.8]
        rng.shuffle(step)
        keys, prompts, outputs, srcs, inflight = [], [], [], [], []
        for key in step:
            seq = live[key]
            if seq["pending"] is not None:  # the previous step's in-flight token reached the host
                seq["out"][-1] = seq["pending"]
                seq["pending"] = None
            shrunk = rng.random() < 0.03 and bool(seq["out"])
            if shrunk:  # the engine never does this; a list shorter than counted is rebuilt, not trusted
                del seq["out"][rng.randrange(len(seq["out"])):]
            src = None
            if rng.random() < 0.4 and not shrunk:
                token = rng.randrange(VOCAB)
                seq["out"].append(-1)  # the placeholder
                seq["pending"] = token
                src = len(inflight)
                inflight.append(token)
            keys.append(key)
            prompts.append(seq["prompt"])
            outputs.append(list(seq["out"]))
            srcs.append(src)
        inflight_t = torch.tensor(inflight, dtype=torch.int64) if inflight else None
        counts, seen = state.rows_for(keys, prompts, outputs, srcs, inflight_t)
        want_counts, want_seen = _reference(prompts, outputs, srcs, inflight_t)
        assert torch.equal(counts, want_counts)
        assert torch.equal(seen, want_seen)
        for key in step:  # new tokens known on the host after the step (1-3: speculation)
            seq = live[key]
            if seq["pending"] is None:
                seq["out"].extend(rng.randrange(VOCAB) for _ in range(rng.choice((1, 1, 1, 2, 3))))
    assert state.capacity > 2 and state.rebuilt > next_seq  # it grew, and rows were rebuilt beyond first use


def test_a_step_reuses_absent_keys_rows_before_growing():
    state = PenaltyState(VOCAB, "cpu", min_rows=2)
    state.rows_for([(1, 0), (2, 0)], [[1], [2]], [[3], [4]], [None, None], None)
    assert state.capacity == 2
    counts, _ = state.rows_for([(3, 0), (4, 0)], [[5], [6]], [[7, 7], [8]], [None, None], None)
    assert state.capacity == 2 and len(state) == 2  # 1 and 2 were absent: their rows went to 3 and 4
    assert counts[0, 7] == 2 and counts[0].sum() == 2 and counts[1, 8] == 1
    state.rows_for([(3, 0), (4, 0), (5, 0)], [[5], [6], []], [[7, 7, 9], [8], []], [None] * 3, None)
    assert state.capacity == 4 and len(state) == 3


def test_duplicate_keys_are_refused():
    with pytest.raises(AssertionError, match="one row per key"):
        PenaltyState(VOCAB, "cpu").rows_for([(1, 0), (1, 0)], [[], []], [[], []], [None, None], None)


def test_sampler_penalties_with_keys_equal_the_stateless_path_over_steps():
    """The sampler's penalized logits with keyed rows (kept counts) equal those of the same rows without keys
    (counted from the lists), step after step, repetition, frequency and presence together."""
    gen = torch.Generator().manual_seed(3)
    params = [SamplingParams(temperature=0, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2),
              SamplingParams(temperature=0, frequency_penalty=-0.5)]
    keyed, plain = Sampler(torch.device("cpu")), Sampler(torch.device("cpu"))
    outputs = [[], [3, 3]]
    prompts = [[1, 2, 3], [4]]
    for _ in range(20):
        logits = torch.randn(2, VOCAB, generator=gen)
        rows = [SampleRow(p, 0, len(o), pr, list(o)) for p, o, pr in zip(params, outputs, prompts)]
        with_keys = [SampleRow(p, 0, len(o), pr, list(o), key=(k, 0))
                     for k, (p, o, pr) in enumerate(zip(params, outputs, prompts))]
        a = keyed._apply_penalties(logits.clone(), with_keys)
        b = plain._apply_penalties(logits.clone(), rows)
        assert torch.equal(a, b)
        tokens = keyed(logits, with_keys).token_ids.tolist()
        for o, t in zip(outputs, tokens):
            o.append(t)
    assert keyed._penalties is not None and keyed._penalties.rebuilt == 2 and plain._penalties is None
