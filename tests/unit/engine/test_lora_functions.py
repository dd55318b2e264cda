"""vLLM's ``llm.llm_engine.add_lora / remove_lora / list_loras / pin_lora`` on the tiny model's adapters."""

from __future__ import annotations

import pytest

from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.adapters.errors import AdapterError
from tests.conftest import adapter_dir

PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PROMPT = {"prompt_token_ids": [1] + list(range(40, 60))}


def _lora(tiny_model, lora_id: int) -> LoRARequest:
    return LoRARequest(f"a{lora_id}", lora_id, adapter_dir(tiny_model, lora_id - 1))


def _llm(tiny_model, **kw) -> LLM:
    return LLM(tiny_model["model_dir"], dtype="float32", enable_lora=True, max_loras=3, max_cpu_loras=3, **kw)


def test_add_pin_list_remove_as_in_vllm(tiny_model):
    llm = _llm(tiny_model)
    engine = llm.llm_engine
    assert engine is llm.engine
    for i in (1, 2, 3):
        assert engine.add_lora(_lora(tiny_model, i)) is True
    assert engine.list_loras() == {1, 2, 3}
    assert engine.pin_lora(1) is True and engine.pin_lora(1) is True  # twice: one pin
    # host memory holds 3 adapters: the least recently added goes, never the pinned one
    for i, want in ((4, {1, 3, 4}), (5, {1, 4, 5}), (6, {1, 5, 6})):
        engine.add_lora(_lora(tiny_model, i))
        assert engine.list_loras() == want
    manager = engine.runner.lora_manager
    slot = manager._slot_of[1]
    assert engine.remove_lora(1) is True
    assert 1 not in engine.list_loras() and 1 not in manager.resident_adapter_ids()
    assert engine.remove_lora(1) is False and engine.remove_lora(99) is False  # unknown ids, as vLLM answers
    assert slot in manager._free_slots


def test_a_pinned_adapter_keeps_its_slot_while_the_others_share_the_rest(tiny_model):
    others = [_lora(tiny_model, i) for i in (3, 4, 5, 6)]  # four adapters through the 1 slot left of 3
    want = [o.outputs[0].token_ids for o in _llm(tiny_model).generate([PROMPT] * 4, PARAMS, lora_request=others)]
    llm = _llm(tiny_model)
    engine = llm.llm_engine
    for i in (1, 2):
        engine.add_lora(_lora(tiny_model, i))
        engine.pin_lora(i)
    manager = engine.runner.lora_manager
    slots = {i: manager._slot_of[i] for i in (1, 2)}
    outs = llm.generate([PROMPT] * 4, PARAMS, lora_request=others)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert {i: manager._slot_of.get(i) for i in (1, 2)} == slots  # never evicted
    pinned = llm.generate([PROMPT], PARAMS, lora_request=_lora(tiny_model, 1))[0].outputs[0].token_ids
    alone = _llm(tiny_model).generate([PROMPT], PARAMS, lora_request=_lora(tiny_model, 1))[0].outputs[0].token_ids
    assert pinned == alone


def test_pin_errors_name_the_problem(tiny_model, tmp_path):
    llm = _llm(tiny_model)
    engine = llm.llm_engine
    with pytest.raises(ValueError, match="^pin_lora: lora_int_id 7 is not registered"):
        engine.pin_lora(7)
    for i in (1, 2, 3):
        engine.add_lora(_lora(tiny_model, i))
    engine.pin_lora(1)
    engine.pin_lora(2)
    with pytest.raises(ValueError, match="^pin_lora: .*max_loras=3"):
        engine.pin_lora(3)  # no slot would be left for the other adapters
    with pytest.raises(TypeError, match="^pin_lora: lora_id must be an integer"):
        engine.pin_lora("3")
    with pytest.raises(AdapterError, match="nope"):
        engine.add_lora(LoRARequest("missing", 9, str(tmp_path / "nope")))
    with pytest.raises(AdapterError, match="already registered for another path"):
        engine.add_lora(LoRARequest("clash", 1, adapter_dir(tiny_model, 4)))
    assert engine.list_loras() == {1, 2, 3}
    assert llm.generate([PROMPT], PARAMS)[0].outputs[0].finish_reason == "length"  # still usable


@pytest.fixture(scope="module")
def plain_llm(tiny_model) -> LLM:
    return LLM(tiny_model["model_dir"], dtype="float32")


@pytest.mark.parametrize("call", [
    lambda e, t: e.add_lora(_lora(t, 1)), lambda e, t: e.remove_lora(1), lambda e, t: e.list_loras(),
    lambda e, t: e.pin_lora(1),
])
def test_lora_functions_without_enable_lora_name_it(plain_llm, tiny_model, call):
    with pytest.raises(ValueError, match="without enable_lora"):
        call(plain_llm.llm_engine, tiny_model)
