"""Scheduler + block manager without a model: continuous batching, preemption, priorities, forks,
prefix caching, adapter limits, leaks, and KV waste."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from loraplex.engine.lora_request import LoRARequest
from loraplex.engine.request import RequestStatus
from loraplex.engine.sampling_params import RequestLimitError, SamplingParams
from tests.unit.engine.fakes import expected_output, fake_run, make_request, make_scheduler, run_to_completion


def test_bookkeeping_modules_do_not_import_torch():
    code = ("import sys; import loraplex.engine.request, loraplex.engine.block_manager, "
            "loraplex.engine.scheduler, loraplex.engine.detokenizer; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_outputs_independent_of_batching_chunking_and_preemption():
    rng = random.Random(0)
    prompts = [[rng.randrange(1000) for _ in range(rng.randint(5, 90))] for _ in range(12)]
    ample = make_scheduler(num_blocks=256)
    tight = make_scheduler(num_blocks=14, max_num_batched_tokens=40)
    for sched in (ample, tight):
        for i, p in enumerate(prompts):
            sched.add_request(make_request(i, p, max_tokens=30))
    want = {(str(i), 0): expected_output(p, 30) for i, p in enumerate(prompts)}
    assert run_to_completion(ample) == want
    assert run_to_completion(tight) == want
    assert ample.num_preemptions == 0
    assert tight.num_preemptions > 0
    for sched in (ample, tight):
        assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_chunked_prefill_respects_token_budget_and_mixes_decodes():
    sched = make_scheduler(max_num_batched_tokens=32)
    sched.add_request(make_request("a", range(10), max_tokens=5))
    sched.add_request(make_request("b", range(100), max_tokens=5))
    steps = []
    run_to_completion(sched, on_step=lambda out: steps.append(
        {s.request.request_id: s.num_new_tokens for s in out.scheduled}))
    assert all(sum(s.values()) <= 32 for s in steps)
    assert steps[0] == {"a": 10, "b": 22}
    assert steps[1] == {"a": 1, "b": 31}  # a decodes while b's prefill continues in chunks


def test_priority_admits_first_and_preempts_lower_priority():
    sched = make_scheduler(num_blocks=8, max_num_seqs=2)
    low = make_request("low", range(60), max_tokens=40, priority=5)
    sched.add_request(low)
    out = sched.schedule()
    sched.update_from_output(out, fake_run(out, 16))
    assert low.status is RequestStatus.RUNNING
    high = make_request("high", range(100, 180), max_tokens=40, priority=0)  # 5 blocks; low holds 4 of 8
    sched.add_request(high)
    out = sched.schedule()
    assert [s.request.request_id for s in out.scheduled] == ["high"]
    assert low.status is RequestStatus.PREEMPTED and out.preempted == [low]
    got = run_to_completion(sched)
    assert got[("low", 0)] == expected_output(list(range(60)), 40)


def test_requests_that_can_never_run_are_refused_naming_the_field_and_limit():
    sched = make_scheduler(num_blocks=4, max_num_seqs=2, max_model_len=100)

    def refused(req) -> RequestLimitError:
        with pytest.raises(RequestLimitError) as err:
            sched.add_request(req)
        return err.value

    err = refused(make_request("n3", range(5), params=SamplingParams(n=3, max_tokens=4)))
    assert (err.param, err.limit) == ("n", 2) and "max_num_seqs" in str(err)
    err = refused(make_request("long", range(100)))
    assert (err.param, err.limit) == ("prompt", 99) and "max_model_len" in str(err)
    err = refused(make_request("big", range(60), max_tokens=20))  # 80 tokens > 4 blocks of 16
    assert (err.param, err.limit) == ("max_tokens", 4) and "KV blocks" in str(err)
    err = refused(make_request("all", range(60), max_tokens=None))  # up to the context: 100 tokens
    assert (err.param, err.limit) == ("max_tokens", 4)
    err = refused(make_request("huge", range(64), max_tokens=1))  # the prompt alone fills the cache
    assert (err.param, err.limit) == ("prompt", 63) and "KV blocks" in str(err)
    assert isinstance(err, ValueError) and not sched.waiting
    sched.add_request(make_request("fits", range(60), max_tokens=4))
    sched.add_request(make_request("ok", range(5)))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("ok", range(5)))
    assert len(sched.waiting) == 2


def test_fcfs_within_priority():
    sched = make_scheduler(max_num_seqs=1)
    for rid in ("x", "y", "z"):
        sched.add_request(make_request(rid, range(5), max_tokens=2))
    order = []
    run_to_completion(sched, on_step=lambda out: order.extend(
        s.request.request_id for s in out.scheduled if s.request.request_id not in order))
    assert order == ["x", "y", "z"]


def test_stop_conditions():
    sched = make_scheduler()
    prompt = list(range(7))
    free_run = expected_output(prompt, 20)
    stop_tok = free_run[4]
    r1 = make_request("eos", prompt, params=SamplingParams(max_tokens=20, temperature=0), eos_token_ids=frozenset({stop_tok}))
    r2 = make_request("ign", prompt, params=SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
                      eos_token_ids=frozenset({stop_tok}))
    r3 = make_request("min", prompt, params=SamplingParams(max_tokens=20, temperature=0, min_tokens=6,
                                                           stop_token_ids=[stop_tok, free_run[7]]))
    for r in (r1, r2, r3):
        sched.add_request(r)
    got = run_to_completion(sched)
    assert got[("eos", 0)] == free_run[:5] and r1.status is RequestStatus.FINISHED_STOPPED
    assert got[("ign", 0)] == free_run and r2.status is RequestStatus.FINISHED_LENGTH
    assert got[("min", 0)] == free_run[:8] and r3.stop_reason == free_run[7]


def test_fork_shares_prompt_blocks_then_copies_on_write():
    sched = make_scheduler(num_blocks=32)
    params = SamplingParams(n=4, max_tokens=6, temperature=1.0)
    parent = make_request("n4", range(40), params=params)  # 2 full blocks + 8 tokens in a third
    sched.add_request(parent)
    out = sched.schedule()
    assert [s.num_samples for s in out.scheduled] == [4]
    sched.update_from_output(out, fake_run(out, 16))
    samples = sched.samples["n4"]
    assert [r.index for r in samples] == [0, 1, 2, 3]
    bm = sched.block_manager
    assert all(r.block_ids == parent.block_ids for r in samples)
    assert [bm.blocks[b].ref_count for b in parent.block_ids] == [4, 4, 4]
    assert bm.num_used_blocks == 3
    shared_tail = parent.block_ids[2]
    out = sched.schedule()  # every sample writes position 40, inside the shared third block
    assert [src for src, _ in out.blocks_to_copy] == [shared_tail] * 3  # the last writer keeps the original
    assert len({r.block_ids[2] for r in samples}) == 4
    assert all(r.block_ids[:2] == samples[0].block_ids[:2] for r in samples)  # full prompt blocks still shared
    assert [bm.blocks[b].ref_count for b in samples[0].block_ids[:2]] == [4, 4]
    sched.update_from_output(out, fake_run(out, 16))
    got = run_to_completion(sched)
    for i in range(4):
        assert got[("n4", i)] == expected_output(list(range(40)), 6, index=i)
    assert bm.num_free_blocks == bm.num_blocks


def test_prefix_cache_hits_only_with_same_adapter_and_salt():
    sched = make_scheduler(num_blocks=64)
    prefix = list(range(500, 564))  # 64 tokens = 4 blocks

    def serve(rid, suffix, **kw):
        req = make_request(rid, prefix + suffix, max_tokens=3, **kw)
        sched.add_request(req)
        before = sched.num_computed_prompt_tokens
        out = run_to_completion(sched)
        return req, sched.num_computed_prompt_tokens - before, out[(rid, 0)]

    first, computed, _ = serve("a", [1, 2, 3])
    assert computed == 67 and first.num_cached_tokens == 0
    second, computed, toks = serve("b", [7, 8, 9, 10])
    assert second.num_cached_tokens == 64 and computed == 4
    assert toks == expected_output(prefix + [7, 8, 9, 10], 3)
    lora = LoRARequest("x", 1, "/nowhere")
    for kw in ({"cache_salt": "tenant-2"}, {"lora_request": lora}):
        req, computed, _ = serve(f"c{len(kw)}{list(kw)[0]}", [7, 8, 9, 10], **kw)
        assert req.num_cached_tokens == 0 and computed == 68
    assert 0 < sched.block_manager.prefix_hit_rate < 1


def test_lru_eviction_keeps_cache_within_capacity():
    sched = make_scheduler(num_blocks=8)
    for i in range(6):  # each prompt fills 4 blocks; only 8 exist
        sched.add_request(make_request(i, [i * 1000 % 997 + k for k in range(64)], max_tokens=1))
        run_to_completion(sched)
    bm = sched.block_manager
    assert bm.num_evictions > 0 and len(bm.hash_to_block) <= 8
    sched.add_request(make_request("again", [5 * 1000 % 997 + k for k in range(64)], max_tokens=1))
    run_to_completion(sched)
    assert sched.samples == {} and bm.num_free_blocks == 8


def test_max_loras_limits_distinct_adapters_without_starvation():
    sched = make_scheduler(max_loras=2, lora_max_wait_steps=4)
    loras = [LoRARequest(f"a{i}", i, "/x") for i in (1, 2, 3)]
    # adapters 1 and 2 get a long stream of requests; adapter 3 arrives early and must still run
    sched.add_request(make_request("r1", range(5), max_tokens=10, lora_request=loras[0]))
    sched.add_request(make_request("r2", range(5), max_tokens=10, lora_request=loras[1]))
    sched.add_request(make_request("r3", range(5), max_tokens=3, lora_request=loras[2]))
    finished3 = False
    for step in range(400):
        if step % 3 == 0 and step < 300:
            sched.add_request(make_request(f"s{step}", range(5), max_tokens=10, lora_request=loras[step % 2]))
        out = sched.schedule()
        assert len(out.lora_ids) <= 2
        for req in sched.update_from_output(out, fake_run(out, 16)):
            finished3 |= req.request_id == "r3" and req.is_finished
        if finished3:
            break
    assert finished3, "a request whose adapter did not fit starved"


def test_random_workload_with_aborts_frees_every_block():
    rng = random.Random(1234)
    sched = make_scheduler(num_blocks=96, max_num_seqs=32, max_num_batched_tokens=256)
    system_prompts = [[rng.randrange(1000) for _ in range(48)] for _ in range(3)]
    live, added = [], 0
    while added < 1000 or sched.has_unfinished_requests():
        for _ in range(rng.randint(0, 4)):
            if added < 1000:
                n = rng.choice([1, 1, 1, 2, 3])
                prompt = rng.choice(system_prompts)[:rng.randint(0, 48)] + [
                    rng.randrange(1000) for _ in range(rng.randint(1, 80))]
                params = SamplingParams(n=n, max_tokens=rng.randint(1, 40), temperature=1.0)
                req = make_request(f"q{added}", prompt, params=params, priority=rng.randint(0, 2),
                                   cache_salt=rng.choice([None, "t1"]))
                sched.add_request(req)
                live.append(req.request_id)
                added += 1
        if live and rng.random() < 0.3:
            sched.abort_request(live.pop(rng.randrange(len(live))))
        out = sched.schedule()
        sched.update_from_output(out, fake_run(out, 16))
        sched.block_manager.check_invariants(sched.running + sched.waiting)
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_blocks and sched.samples == {}
    assert sched.num_preemptions > 0 and bm.num_prefix_hit_tokens > 0 and bm.num_cow_copies > 0


def _exact_waste(sched, out) -> float:
    """Independent computation: count every slot of every used block."""
    bs = sched.block_manager.block_size
    new = {s.request.seq_id: s.num_new_tokens for s in out.scheduled}
    filled: dict[int, int] = {}
    for req in sched.running:
        n = req.num_computed_tokens + new.get(req.seq_id, 0)
        for i, b in enumerate(req.block_ids):
            filled[b] = max(filled.get(b, 0), min(bs, n - i * bs))
    allocated = sched.block_manager.num_used_blocks * bs
    return (allocated - sum(filled.values())) / allocated if allocated else 0.0


def test_kv_waste_below_four_percent():
    rng = random.Random(7)
    sched = make_scheduler(num_blocks=1200, max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=2048)
    samples, added = [], 0
    while added < 150 or sched.has_unfinished_requests():
        if added < 150 and sched.num_unfinished < 48:
            prompt = [rng.randrange(1000) for _ in range(rng.randint(128, 1024))]
            sched.add_request(make_request(f"w{added}", prompt, max_tokens=rng.randint(16, 256)))
            added += 1
        out = sched.schedule()
        assert abs(sched.last_kv_waste - _exact_waste(sched, out)) < 1e-12
        samples.append(sched.last_kv_waste)
        sched.update_from_output(out, fake_run(out, 16))
    mean = sum(samples) / len(samples)
    print(f"KV waste over {len(samples)} steps: mean {mean:.4%}, max {max(samples):.4%}")
    assert mean < 0.04


class _Gate:
    """Adapters always in host memory; ``resident`` names the ones holding a GPU slot."""

    def __init__(self, resident=()):
        self.resident = set(resident)

    def poll(self, waiting):
        list(waiting)
        return {}

    def is_ready(self, adapter_id):
        return True

    def is_resident(self, adapter_id):
        return adapter_id in self.resident

    def wait_for_load(self, timeout):
        return False

    def take_dropped(self):
        return []

    def kept_adapter_ids(self):
        return set()


def _grouping_scheduler(resident=(), **kw):
    sched = make_scheduler(**{"num_blocks": 512, "lora_grouping": True, **kw})
    sched.adapters = _Gate(resident)
    return sched


def _lora(i):
    return LoRARequest(f"a{i}", i, "/x")


def _admitted(sched) -> list[str]:
    out = sched.schedule()
    sched.update_from_output(out, fake_run(out, sched.block_manager.block_size))
    return [s.request.request_id for s in out.scheduled if s.request.num_output_tokens <= 1]


def test_grouping_admits_requests_of_running_adapters_first_then_groups_by_adapter():
    sched = _grouping_scheduler(max_num_seqs=3, max_loras=4)
    sched.add_request(make_request("x0", range(5), max_tokens=30, lora_request=_lora(1)))
    assert _admitted(sched) == ["x0"]
    for rid, lora in (("y1", 2), ("x1", 1), ("z1", 3), ("y2", 2), ("x2", 1)):
        sched.add_request(make_request(rid, range(5), max_tokens=30, lora_request=_lora(lora)))
    # two free sequences: adapter 1 runs, so its requests pass the older y1
    assert sorted(_admitted(sched)) == ["x1", "x2"]
    assert [r.request_id for r in sched.waiting] == ["y1", "z1", "y2"]
    assert all(r.wait_steps == 1 for r in sched.waiting)


def test_grouping_batches_held_requests_by_adapter_in_order_of_their_oldest():
    sched = _grouping_scheduler(max_num_seqs=2, max_loras=2)
    for rid, lora in (("y1", 2), ("z1", 3), ("y2", 2), ("z2", 3)):
        sched.add_request(make_request(rid, range(5), max_tokens=4, lora_request=_lora(lora)))
    assert _admitted(sched) == ["y1", "y2"]  # FCFS would run y1 and z1: two adapters in every step


def test_grouping_skips_a_request_at_most_lora_group_max_skips_times():
    sched = _grouping_scheduler(max_num_seqs=2, max_loras=2, lora_group_max_skips=3)
    sched.add_request(make_request("x0", range(5), max_tokens=60, lora_request=_lora(1)))
    sched.add_request(make_request("cold", range(5), max_tokens=2, lora_request=_lora(2)))
    for i in range(1, 7):
        sched.add_request(make_request(f"x{i}", range(5), max_tokens=2, lora_request=_lora(1)))
    order = []
    while sched.has_unfinished_requests():
        order += _admitted(sched)
    # adapter 1 keeps running, so its requests pass "cold" three times; then "cold" takes its FCFS place
    assert order == ["x0", "x1", "x2", "x3", "cold", "x4", "x5", "x6"]


def test_grouping_is_off_when_slots_are_scarce_or_disabled():
    for kw in ({"max_num_seqs": 3, "max_loras": 2}, {"max_num_seqs": 3, "max_loras": 4, "lora_grouping": False}):
        # (grouping asked for but slots scarce; grouping not asked for)
        sched = _grouping_scheduler(resident={2}, **kw)
        sched.add_request(make_request("x0", range(5), max_tokens=30, lora_request=_lora(1)))
        _admitted(sched)
        for rid, lora in (("y1", 2), ("x1", 1), ("x2", 1)):
            sched.add_request(make_request(rid, range(5), max_tokens=30, lora_request=_lora(lora)))
        # y1's adapter holds a slot: it needs no new one and keeps its FCFS place
        assert sorted(_admitted(sched)) == ["x1", "y1"], kw


@pytest.mark.parametrize("popularity", ["zipf", "uniform"])
def test_grouping_cuts_adapters_per_step_and_changes_no_output(popularity):
    rng = random.Random(3)
    n = 120
    if popularity == "zipf":
        weights = [1 / (i + 1) ** 1.5 for i in range(n)]
        loras = rng.choices(range(1, n + 1), weights=weights, k=n)
    else:
        loras = [rng.randrange(1, 12) for _ in range(n)]
    prompts = [[rng.randrange(1000) for _ in range(rng.randint(5, 30))] for _ in range(n)]
    adapter_steps, outputs = {}, {}
    for grouping in (False, True):
        sched = _grouping_scheduler(max_num_seqs=16, max_loras=16, num_blocks=2048, lora_grouping=grouping)
        for i, (p, lora) in enumerate(zip(prompts, loras, strict=True)):
            sched.add_request(make_request(i, p, max_tokens=12, lora_request=_lora(lora)))
        counts = []
        outputs[grouping] = run_to_completion(sched, on_step=lambda out, c=counts: c.append(len(out.lora_ids)))
        adapter_steps[grouping] = sum(counts)
    want = {(str(i), 0): expected_output(p, 12) for i, p in enumerate(prompts)}
    assert outputs[False] == want and outputs[True] == want
    assert adapter_steps[True] < 0.85 * adapter_steps[False], adapter_steps


def _step(sched) -> set[str]:
    """One step with the fake model; the ids of the requests it scheduled."""
    out = sched.schedule()
    sched.update_from_output(out, fake_run(out, 16))
    return {s.request.request_id for s in out.scheduled}


def test_prefill_batching_holds_small_prompts_while_decoding_until_the_wait_bound():
    sched = make_scheduler(prefill_batch_min_running=1, prefill_batch_min_tokens=100, prefill_batch_max_wait_steps=4)
    sched.add_request(make_request("run", range(10), max_tokens=50))
    assert _step(sched) == {"run"}  # nothing was running: admitted at once
    sched.add_request(make_request("small", range(20), max_tokens=5))
    steps = [_step(sched) for _ in range(4)]
    # held 3 steps while "run" decoded; the gate opens on the 4th
    assert steps == [{"run"}, {"run"}, {"run"}, {"run", "small"}]
    assert sched.num_prefill_held_steps == 3 and sched.prefill_held_steps == 0

def test_prefill_batching_admits_once_enough_prompt_tokens_wait_and_never_holds_an_idle_engine():
    sched = make_scheduler(prefill_batch_min_running=1, prefill_batch_min_tokens=100, prefill_batch_max_wait_steps=50)
    sched.add_request(make_request("run", range(10), max_tokens=50))
    _step(sched)
    sched.add_request(make_request("a", range(60), max_tokens=5))
    out = sched.schedule()
    assert {s.request.request_id for s in out.scheduled} == {"run"}  # 60 < 100 tokens wait: held
    sched.update_from_output(out, fake_run(out, 16))
    sched.add_request(make_request("b", range(50), max_tokens=5))
    out = sched.schedule()
    assert {s.request.request_id for s in out.scheduled} == {"run", "a", "b"}  # 110 tokens: one prefill step
    sched.update_from_output(out, fake_run(out, 16))
    idle = make_scheduler(prefill_batch_min_tokens=10_000)
    idle.add_request(make_request("x", range(5), max_tokens=2))
    assert [s.request.request_id for s in idle.schedule().scheduled] == ["x"]


def test_prefill_batching_never_holds_a_request_that_outranks_the_running_ones():
    sched = make_scheduler(prefill_batch_min_running=1, prefill_batch_min_tokens=1000, prefill_batch_max_wait_steps=50)
    sched.add_request(make_request("low", range(10), max_tokens=50, priority=5))
    _step(sched)
    sched.add_request(make_request("urgent", range(8), max_tokens=5, priority=0))
    assert "urgent" in {s.request.request_id for s in sched.schedule().scheduled}


def test_prefill_batching_changes_no_output():
    rng = random.Random(3)
    prompts = [[rng.randrange(1000) for _ in range(rng.randint(5, 60))] for _ in range(16)]
    want = {(str(i), 0): expected_output(p, 12) for i, p in enumerate(prompts)}
    for min_tokens in (0, 64, 300):
        sched = make_scheduler(prefill_batch_min_running=1, prefill_batch_min_tokens=min_tokens,
                               prefill_batch_max_wait_steps=3)
        pending = list(enumerate(prompts))
        got = {}
        while pending or sched.has_unfinished_requests():
            if pending:  # a new request every step: a steady arrival stream
                i, p = pending.pop(0)
                sched.add_request(make_request(i, p, max_tokens=12))
            out = sched.schedule()
            for req in sched.update_from_output(out, fake_run(out, 16)):
                if req.is_finished:
                    got[(req.request_id, 0)] = req.output_token_ids
        assert got == want, min_tokens
        assert (sched.num_prefill_held_steps > 0) == (min_tokens > 0)


def test_prefill_batching_holds_nothing_at_low_load():
    sched = make_scheduler(prefill_batch_min_tokens=1000, prefill_batch_max_wait_steps=50, prefill_batch_min_running=3)
    for rid in ("r1", "r2"):
        sched.add_request(make_request(rid, range(10), max_tokens=50))
    _step(sched)
    sched.add_request(make_request("small", range(8), max_tokens=5))
    assert "small" in _step(sched)  # 2 running < 3: admitted at once
    sched.add_request(make_request("held", range(8), max_tokens=5))
    assert "held" not in _step(sched)  # 3 running now: held (8 tokens < 1000)
