"""Adapter reads off the engine thread (CPU, float32, real adapter files): a slow read delays only its own
request, a failed read fails only its request (every sample), removal and replacement of an id while its
read is in flight, and the scheduler's order: a request whose adapter is not in host memory blocks nobody
and keeps its place; within a priority, requests needing no new slot go first, and the others age.

Slowness is real but controlled: ``held_reads`` blocks chosen reads on their loader worker (fault
injection) until the test releases them."""

from __future__ import annotations

import time

import pytest
import torch

from loraplex.adapters.manager import LoRAManager
from loraplex.engine.config import EngineConfig
from loraplex.engine.engine_core import LLMEngine
from loraplex.engine.lora_request import LoRARequest
from loraplex.engine.request import RequestStatus
from loraplex.engine.sampling_params import SamplingParams
from tests.conftest import adapter_dir, nan_adapter
from tests.unit.adapters.held_reads import hold
from tests.unit.engine.conftest import hf_greedy
from tests.unit.engine.fakes import expected_output, fake_run, make_request, make_scheduler, run_to_completion

MAX_NEW = 6
PARAMS = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
PROMPTS = [[1] + list(range(40 + 9 * i, 52 + 11 * i)) for i in range(4)]


def _engine(tiny_model, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=tiny_model["model_dir"], dtype="float32", enable_lora=True, max_loras=4,
                                  max_lora_rank=64, **kw))


def _lora(tiny_model, adapter_id: int, index: int) -> LoRARequest:
    return LoRARequest(f"adapter-{index}", adapter_id, adapter_dir(tiny_model, index))


def _step_until(engine: LLMEngine, got: dict, done, max_steps: int = 400) -> None:
    """Step the engine, collecting deltas by (request id, index), until ``done()`` (at most max_steps)."""
    for _ in range(max_steps):
        if done():
            return
        for d in engine.step():
            got.setdefault((d.request_id, d.index), []).append(d)
    raise AssertionError("the engine did not get there")


def _finished(got: dict, key) -> bool:
    return any(d.finished for d in got.get(key, []))


def _tokens(got: dict, key) -> list[int]:
    return [t for d in got[key] for t in d.token_ids]


@pytest.fixture(scope="module")
def peft_greedy(tiny_model, hf_llama):
    """Greedy tokens of HF + PEFT with adapter ``index`` (None: the base model)."""
    from peft import PeftModel

    cache: dict = {}

    def greedy(prompt: list[int], index: int | None) -> list[int]:
        key = (tuple(prompt), index)
        if key not in cache:
            if index is None:
                cache[key] = hf_greedy(hf_llama, prompt, MAX_NEW)
            else:
                peft = PeftModel.from_pretrained(hf_llama, adapter_dir(tiny_model, index))
                with torch.no_grad():
                    cache[key] = hf_greedy(peft, prompt, MAX_NEW)
                peft.unload()
        return cache[key]

    return greedy


def test_slow_adapter_read_delays_only_its_own_request(tiny_model, peft_greedy):
    engine = _engine(tiny_model)
    manager = engine.runner.get_lora_manager()
    held = hold(manager, adapter_dir(tiny_model, 3))
    started = time.monotonic()
    engine.add_request("slow", PROMPTS[0], PARAMS, lora_request=_lora(tiny_model, 4, 3))
    engine.add_request("base", PROMPTS[1], PARAMS)
    engine.add_request("fast", PROMPTS[2], PARAMS, lora_request=_lora(tiny_model, 2, 1))
    assert time.monotonic() - started < 1.0  # add_request never waits for a read
    assert held.started.wait(10)
    got: dict = {}
    _step_until(engine, got, lambda: _finished(got, ("base", 0)) and _finished(got, ("fast", 0)))
    # the slow request is still waiting for its read, at the head of the queue; the others are done
    assert ("slow", 0) not in got and engine.scheduler.waiting[0].request_id == "slow"
    counters = engine.counters
    assert counters["lora_load_queue_depth"] == 1 and counters["lora_loading_adapters"] == 1
    held.release()
    _step_until(engine, got, lambda: not engine.has_unfinished_requests())
    assert _tokens(got, ("slow", 0)) == peft_greedy(PROMPTS[0], 3)
    assert _tokens(got, ("fast", 0)) == peft_greedy(PROMPTS[2], 1)
    assert _tokens(got, ("base", 0)) == peft_greedy(PROMPTS[1], None)
    assert engine.counters["lora_host_loads"] == 2 and engine.counters["lora_load_queue_depth"] == 0


def test_failed_read_fails_only_its_request_and_every_sample(tiny_model, peft_greedy, tmp_path):
    bad = nan_adapter(tiny_model, 1, tmp_path / "bad")
    engine = _engine(tiny_model)
    held = hold(engine.runner.get_lora_manager(), str(bad))
    engine.add_request("good", PROMPTS[0], PARAMS, lora_request=_lora(tiny_model, 1, 0))
    two = SamplingParams(n=2, max_tokens=MAX_NEW, temperature=0.7, seed=3, ignore_eos=True)
    engine.add_request("bad", PROMPTS[1], two, lora_request=LoRARequest("bad", 50, str(bad)))
    engine.add_request("base", PROMPTS[2], PARAMS)
    got: dict = {}
    _step_until(engine, got, lambda: ("good", 0) in got)  # the good request is running: now let the read fail
    held.release()
    _step_until(engine, got, lambda: not engine.has_unfinished_requests())
    for index in (0, 1):
        (final,) = got[("bad", index)]
        assert final.finished and final.finish_reason == "error" and "NaN" in final.error and not final.token_ids
    assert _tokens(got, ("good", 0)) == peft_greedy(PROMPTS[0], 0)
    assert _tokens(got, ("base", 0)) == peft_greedy(PROMPTS[2], None)
    assert engine.counters["lora_load_failures"] == 1


def test_removal_and_replacement_while_a_read_is_in_flight(tiny_model, peft_greedy):
    engine = _engine(tiny_model)
    manager = engine.runner.get_lora_manager()
    held = hold(manager, adapter_dir(tiny_model, 0), adapter_dir(tiny_model, 4))
    engine.add_request("v1", PROMPTS[0], PARAMS, lora_request=_lora(tiny_model, 7, 0))
    engine.add_request("kept", PROMPTS[1], PARAMS, lora_request=_lora(tiny_model, 9, 4))
    assert held.started.wait(10)
    got: dict = {}
    engine.step()
    manager.remove_adapter(7)  # a new version of id 7 follows; its old read is still held
    manager.remove_adapter(9)  # removed with no new version: the request queued before still runs
    engine.add_request("v2", PROMPTS[2], PARAMS, lora_request=_lora(tiny_model, 7, 2))
    idle = engine.counters["num_adapter_wait_steps"]
    for _ in range(3):
        assert engine.step() == []  # both loader workers hold a read: nothing is ready yet
    assert engine.counters["num_adapter_wait_steps"] == idle + 3  # each of those steps waited for a read
    assert engine.counters["adapter_wait_seconds"] > 0
    held.release()
    _step_until(engine, got, lambda: not engine.has_unfinished_requests())
    # id 7 serves its new version to both requests (weights follow the id), never the old read
    assert _tokens(got, ("v1", 0)) == peft_greedy(PROMPTS[0], 2)
    assert _tokens(got, ("v2", 0)) == peft_greedy(PROMPTS[2], 2)
    assert _tokens(got, ("kept", 0)) == peft_greedy(PROMPTS[1], 4)


# ---- the scheduler's order, with a real LoRA manager and the model-free runner -----------------------

@pytest.fixture(scope="module")
def hf_config(tiny_model):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(tiny_model["model_dir"])


def _scheduler(hf_config, **kw):
    sched = make_scheduler(**kw)
    sched.adapters = LoRAManager(hf_config, max_loras=sched.config.max_loras, max_lora_rank=64, max_cpu_loras=None,
                                 device="cpu", dtype=torch.float32, num_load_workers=1)
    return sched


def _step(sched):
    out = sched.schedule()
    sched.update_from_output(out, fake_run(out, sched.block_manager.block_size))
    return [s.request.request_id for s in out.scheduled]


def test_request_waiting_for_its_adapter_blocks_nobody_and_keeps_its_place(tiny_model, hf_config):
    sched = _scheduler(hf_config)
    manager = sched.adapters
    slow, ready = _lora(tiny_model, 1, 0), _lora(tiny_model, 2, 1)
    manager.validate_and_prefetch(ready)
    held = hold(manager, slow.lora_path)
    requests = [make_request("slow", range(5), lora_request=slow), make_request("base", range(6)),
                make_request("ready", range(7), lora_request=ready)]
    for req in requests:
        sched.add_request(req)
        if req.lora_request is not None:
            manager.submit(req.lora_request)
    assert held.started.wait(10)
    assert sorted(_step(sched)) == ["base", "ready"]
    assert sched.waiting == [requests[0]] and requests[0].status is RequestStatus.WAITING
    assert requests[0].wait_steps == 0  # not held against it: it could not run
    held.release()
    assert manager.wait_for_load(10)
    assert "slow" in _step(sched)
    want = {(r.request_id, 0): expected_output(r.prompt_token_ids, 8) for r in requests}
    assert run_to_completion(sched) == want


def test_requests_needing_no_new_slot_go_first_within_a_priority_and_others_age(tiny_model, hf_config):
    sched = _scheduler(hf_config, max_num_seqs=1, max_loras=2, lora_max_wait_steps=3)
    manager = sched.adapters
    cold, hot = _lora(tiny_model, 1, 0), _lora(tiny_model, 2, 1)
    for lora in (cold, hot):
        manager.validate_and_prefetch(lora)
    manager.assign_slots([2])  # "hot" holds a GPU slot, "cold" is only in host memory
    first = make_request("cold", range(5), max_tokens=2, lora_request=cold)
    sched.add_request(first)
    urgent = make_request("urgent", range(5), max_tokens=2, lora_request=cold, priority=-1)
    sched.add_request(urgent)
    for i in range(6):
        sched.add_request(make_request(f"hot{i}", range(5), max_tokens=2, lora_request=hot))
    order = []
    while sched.has_unfinished_requests():
        for rid in _step(sched):
            if not order or order[-1] != rid:
                order.append(rid)
    # a higher priority goes first whatever its adapter; then resident-adapter requests pass the older
    # "cold" request until it has been passed over lora_max_wait_steps (3) times, then it takes its place
    assert order == ["urgent", "hot0", "hot1", "hot2", "cold", "hot3", "hot4", "hot5"]
