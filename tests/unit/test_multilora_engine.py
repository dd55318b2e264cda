"""Multi-LoRA through the engine (float32, CPU): every request gets exactly the greedy tokens of Hugging Face
+ PEFT with its own adapter alone, in mixed batches with base requests, late arrivals, more adapters than
GPU slots, and a malformed adapter that fails only its own request."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch

from loraplex import LLM, SamplingParams
from loraplex.engine.config import EngineConfig
from loraplex.engine.engine_core import LLMEngine
from loraplex.engine.lora_request import LoRARequest
from tests.conftest import adapter_dir, nan_adapter

MAX_NEW = 8
NUM_ADAPTERS = 6  # ranks 8, 16, 4, 32, 12, 64 over four different target-module sets
PARAMS = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)


def _lora(tiny_model, i: int) -> LoRARequest:
    return LoRARequest(f"adapter-{i}", i + 1, adapter_dir(tiny_model, i))


def _workload(seed: int) -> list[tuple[list[int], int | None]]:
    """(prompt, adapter index or None): every adapter at least once, some twice, and base requests."""
    rng = random.Random(seed)
    owners = [*range(NUM_ADAPTERS), None, 2, None, 5, 0, None]
    return [([1] + [rng.randrange(8, 500) for _ in range(rng.choice([2, 5, 9, 21, 40]))], o) for o in owners]


@pytest.fixture(scope="module")
def hf_reference(tiny_model):
    """Greedy tokens of HF (+ PEFT with one adapter) per (prompt, adapter), computed once per prompt set."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cache: dict[tuple[tuple[int, ...], int | None], list[int]] = {}
    models: dict[int | None, torch.nn.Module] = {}

    def model_for(owner):
        if owner not in models:
            base = AutoModelForCausalLM.from_pretrained(tiny_model["model_dir"], dtype=torch.float32).eval()
            models[owner] = base if owner is None else PeftModel.from_pretrained(
                base, adapter_dir(tiny_model, owner)).eval()
        return models[owner]

    def greedy(prompt: list[int], owner: int | None) -> list[int]:
        key = (tuple(prompt), owner)
        if key not in cache:
            # plain argmax decoding: generate(min_new_tokens=...) would mask EOS, which ignore_eos does not
            seq = list(prompt)
            with torch.no_grad():
                for _ in range(MAX_NEW):
                    seq.append(int(model_for(owner)(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
            cache[key] = seq[len(prompt):]
        return cache[key]

    return greedy


def _run_joining_mid_run(engine: LLMEngine, tiny_model, work) -> dict[str, list[int]]:
    got = {str(i): [] for i in range(len(work))}
    nxt, step = 0, 0
    while nxt < len(work) or engine.has_unfinished_requests():
        if nxt < len(work) and (nxt < 4 or step % 2 == 0):  # four at once, then one every other step
            prompt, owner = work[nxt]
            engine.add_request(str(nxt), prompt, PARAMS,
                               lora_request=None if owner is None else _lora(tiny_model, owner))
            nxt += 1
        step += 1
        for d in engine.step():
            assert d.error is None, d.error
            got[d.request_id].extend(d.token_ids)
    return got


def test_mixed_adapters_and_base_requests_joining_mid_run_match_peft(tiny_model, hf_reference):
    work = _workload(seed=1)
    engine = LLMEngine(EngineConfig(model=tiny_model["model_dir"], dtype="float32", enable_lora=True,
                                    max_loras=8, max_lora_rank=64, max_num_batched_tokens=48))
    manager = engine.runner.get_lora_manager()
    steps = _record_steps(manager, engine)
    got = _run_joining_mid_run(engine, tiny_model, work)
    for i, (prompt, owner) in enumerate(work):
        assert got[str(i)] == hf_reference(prompt, owner), f"request {i} (adapter {owner}, {len(prompt)} tokens)"
    # the batches really were mixed: >= 4 adapters in one step, base tokens beside adapter tokens
    assert max(n for n, _ in steps) >= 4 and any(n and has_base for n, has_base in steps)
    assert manager.num_loads == NUM_ADAPTERS and manager.num_evictions == 0
    # the adapters really change the output (otherwise this test could not fail)
    first = work[0][0]
    assert len({tuple(hf_reference(first, o)) for o in [None, *range(NUM_ADAPTERS)]}) >= 5


def _record_steps(manager, engine) -> list[tuple[int, bool]]:
    """(distinct adapters, any base-model token) for every step the engine runs with adapters; also checks that
    no adapter of a running request loses its slot when a step's adapters get theirs."""
    steps = []
    prepare, assign = manager.prepare_step, manager.assign_slots

    def recording(token_adapter_ids, adapter_ids=None, slot_of=None, has_base_tokens=True, **kw):
        has_base = bool((token_adapter_ids == 0).any())
        assert has_base_tokens or not has_base, "a step with base tokens was told it has none"
        steps.append((len(slot_of), has_base))
        return prepare(token_adapter_ids, adapter_ids=adapter_ids, slot_of=slot_of, has_base_tokens=has_base_tokens,
                       **kw)

    def assigning(adapter_ids, **kw):
        running = {r.lora_id for r in engine.scheduler.running if r.lora_id}
        assert running <= set(manager.pinned_adapter_ids()), "running requests' adapters must be pinned"
        kept = running & set(manager.resident_adapter_ids())
        slot_of = assign(adapter_ids, **kw)
        assert kept <= set(manager.resident_adapter_ids()), "a running request's adapter was evicted"
        return slot_of

    manager.prepare_step, manager.assign_slots = recording, assigning
    return steps


def test_more_adapters_than_slots_all_complete_with_loads_and_evictions(tiny_model, hf_reference):
    work = _workload(seed=2)
    engine = LLMEngine(EngineConfig(model=tiny_model["model_dir"], dtype="float32", enable_lora=True,
                                    max_loras=2, max_lora_rank=64, max_cpu_loras=3, max_num_batched_tokens=48))
    manager = engine.runner.get_lora_manager()
    steps = _record_steps(manager, engine)
    got = _run_joining_mid_run(engine, tiny_model, work)
    for i, (prompt, owner) in enumerate(work):
        assert got[str(i)] == hf_reference(prompt, owner), f"request {i} (adapter {owner})"
    assert max(n for n, _ in steps) == 2  # never more adapters in a step than slots
    assert manager.num_loads > NUM_ADAPTERS and manager.num_evictions > 0
    assert len(manager.resident_adapter_ids()) <= 2
    assert manager.num_host_loads > NUM_ADAPTERS  # the host cache (3) is smaller than the adapter set too


def test_malformed_adapter_fails_only_its_request(tiny_model, hf_reference, tmp_path):
    bad = nan_adapter(tiny_model, 1, Path(tmp_path) / "bad")
    pickled = tmp_path / "pickled"
    shutil.copytree(adapter_dir(tiny_model, 2), pickled)
    (pickled / "adapter_model.bin").write_bytes(b"\x80\x04")

    llm = LLM(tiny_model["model_dir"], dtype="float32", enable_lora=True, max_loras=4, max_lora_rank=64)
    work = _workload(seed=3)[:4]
    prompts = [{"prompt_token_ids": p} for p, _ in work] + [{"prompt_token_ids": work[0][0]}] * 2
    loras = [_lora(tiny_model, o) for _, o in work] + [LoRARequest("bad", 50, str(bad)),
                                                       LoRARequest("pickled", 51, str(pickled))]
    outs = llm.generate(prompts, PARAMS, lora_request=loras)
    for (prompt, owner), out in zip(work, outs):
        assert out.outputs[0].token_ids == hf_reference(prompt, owner)
    for out, what in zip(outs[4:], ("NaN", "pickle")):
        comp = out.outputs[0]
        assert comp.finish_reason == "error" and comp.token_ids == [] and what in comp.error
    # the engine keeps serving afterwards, the good adapters included
    again = llm.generate(prompts[0], PARAMS, lora_request=loras[0])[0]
    assert again.outputs[0].token_ids == hf_reference(work[0][0], work[0][1])


def test_many_ids_over_few_files_match_peft_and_read_each_file_once(tiny_model, hf_reference):
    """The offline bench's shape: adapter k -> id k+1, file k % 3. Ids sharing a file share one validated
    copy, and each still gets exactly its file's PEFT tokens, through slot evictions."""
    llm = LLM(tiny_model["model_dir"], dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=64,
              max_cpu_loras=3)  # holds 3 of the 9 ids: without sharing, 6 would be read twice
    work = _workload(seed=4)[:3]
    prompts, loras, owners = [], [], []
    for k in range(9):
        prompt, _ = work[k % 3]
        prompts.append({"prompt_token_ids": prompt})
        loras.append(LoRARequest(f"tenant-{k}", k + 1, adapter_dir(tiny_model, k % 3)))
        owners.append((prompt, k % 3))
    outs = llm.generate(prompts, PARAMS, lora_request=loras)
    for (prompt, owner), out in zip(owners, outs):
        assert out.outputs[0].token_ids == hf_reference(prompt, owner)
    manager = llm.engine.runner.get_lora_manager()
    assert manager.num_host_loads == 3 and manager.num_host_reuses > 0
    assert manager.num_loads == 9 and manager.num_evictions == 7
    assert manager.num_prefetched_loads > 0  # slots filled for waiting requests before their step
