"""Adapters through the engine: mixed-adapter batches match PEFT, a broken adapter fails only its request,
and the prefix cache never crosses adapters."""

from __future__ import annotations

import pytest
import torch

from loraplex import LLM, LoRARequest, SamplingParams
from tests.conftest import adapter_dir
from tests.unit.engine.conftest import hf_greedy

PARAMS = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
PROMPT = [1] + list(range(30, 60)) + list(range(100, 140))  # 71 tokens: 4 full blocks


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(tiny_model["model_dir"], dtype="float32", enable_lora=True, max_loras=2)


def test_mixed_adapter_batch_matches_peft(llm, tiny_model, hf_llama):
    from peft import PeftModel

    loras = [None, LoRARequest("a0", 1, adapter_dir(tiny_model, 0)), LoRARequest("a1", 2, adapter_dir(tiny_model, 1)),
             LoRARequest("a2", 3, adapter_dir(tiny_model, 2))]  # three adapters with max_loras=2: some wait
    prompts = [{"prompt_token_ids": PROMPT[: 20 + 7 * i]} for i in range(len(loras))]
    outs = llm.generate(prompts, PARAMS, lora_request=loras)
    assert outs[0].outputs[0].token_ids == hf_greedy(hf_llama, prompts[0]["prompt_token_ids"], 10)
    for i in range(1, 4):
        peft = PeftModel.from_pretrained(hf_llama, adapter_dir(tiny_model, i - 1))
        with torch.no_grad():
            want = hf_greedy(peft, prompts[i]["prompt_token_ids"], 10)
        peft.unload()
        assert outs[i].outputs[0].token_ids == want, f"adapter {i - 1}"
    stats = llm.engine.get_stats()
    assert len(stats.active_adapters) == 2 and set(stats.active_adapters) <= {"a0", "a1", "a2"}
    assert stats.num_lora_loads >= 3


def test_broken_adapter_fails_only_its_request(llm, tmp_path):
    bad = LoRARequest("missing", 9, str(tmp_path / "nope"))
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * 2, PARAMS, lora_request=[bad, None])
    assert outs[0].outputs[0].finish_reason == "error" and outs[0].outputs[0].error
    assert outs[1].outputs[0].finish_reason == "length" and len(outs[1].outputs[0].token_ids) == 10


def test_prefix_cache_is_per_adapter(llm, tiny_model):
    lora = LoRARequest("a0", 1, adapter_dir(tiny_model, 0))
    prompt = {"prompt_token_ids": PROMPT[:1] + list(range(200, 270))}
    base = llm.generate([prompt], PARAMS)[0]
    with_lora = llm.generate([prompt], PARAMS, lora_request=lora)[0]
    again = llm.generate([prompt], PARAMS, lora_request=lora)[0]
    assert base.num_cached_tokens == 0 and with_lora.num_cached_tokens == 0
    assert again.num_cached_tokens == 64
    assert again.outputs[0].token_ids == with_lora.outputs[0].token_ids != base.outputs[0].token_ids


def test_new_version_under_a_removed_id_never_reuses_the_old_versions_kv(llm, tiny_model):
    """Removing an adapter right after its requests finished, then registering other weights under the same
    id: the new request runs (the finished requests' pins do not defer the removal) and does not take the
    prefix-cache blocks computed with the old weights (same id, same prompt, same salt)."""
    prompt = {"prompt_token_ids": PROMPT[:1] + list(range(300, 370))}
    fresh = LLM(tiny_model["model_dir"], dtype="float32", enable_lora=True, max_loras=2, enable_prefix_caching=False)
    want = fresh.generate([prompt], PARAMS, lora_request=LoRARequest("v2", 5, adapter_dir(tiny_model, 1)))[0]
    old = llm.generate([prompt], PARAMS, lora_request=LoRARequest("v1", 5, adapter_dir(tiny_model, 0)))[0]
    assert old.outputs[0].token_ids != want.outputs[0].token_ids
    llm.engine.remove_adapter(5)
    new = llm.generate([prompt], PARAMS, lora_request=LoRARequest("v2", 5, adapter_dir(tiny_model, 1)))[0]
    assert new.outputs[0].finish_reason == "length", new.outputs[0].error
    assert new.num_cached_tokens == 0
    assert new.outputs[0].token_ids == want.outputs[0].token_ids
    again = llm.generate([prompt], PARAMS, lora_request=LoRARequest("v2", 5, adapter_dir(tiny_model, 1)))[0]
    assert again.num_cached_tokens == 64 and again.outputs[0].token_ids == want.outputs[0].token_ids
    llm.engine.block_manager.check_invariants([])


def test_stats_and_metrics_name_the_adapters_requests_use(llm, tiny_model):
    """vllm:lora_requests_info names the adapters of running and waiting requests (as vLLM does), not the
    ones merely resident in GPU slots: with nothing running both labels are empty."""
    from loraplex.platform.metrics import Metrics

    engine = llm.engine
    loras = [LoRARequest(f"a{i}", i + 1, adapter_dir(tiny_model, i)) for i in range(3)]
    for i, lora in enumerate([*loras, None]):
        engine.add_request(f"stats-{i}", PROMPT[:20], PARAMS, lora_request=lora)
    seen_running, seen_waiting = set(), set()
    while engine.has_unfinished_requests():
        engine.step()
        stats = engine.get_stats()
        assert len(stats.running_adapters) <= 2  # max_loras=2
        seen_running |= set(stats.running_adapters)
        seen_waiting |= set(stats.waiting_adapters)
    assert seen_running == {"a0", "a1", "a2"} and seen_waiting  # adapters still loading: their requests wait
    stats = engine.get_stats()
    assert stats.running_adapters == stats.waiting_adapters == [] and stats.active_adapters

    metrics = Metrics()
    metrics.attach_engine(lambda: "tiny", engine.get_stats, max_loras=2)
    info = [line for line in metrics.render().decode().splitlines() if line.startswith("vllm:lora_requests_info")]
    assert len(info) == 1 and 'running_lora_adapters=""' in info[0] and 'waiting_lora_adapters=""' in info[0]


def test_a_lora_request_to_an_engine_without_enable_lora_is_refused_before_anything_runs(tiny_model):
    """vLLM refuses it ("LoRA is not enabled"); it was queued and came back as an output with finish_reason "error"
    and no text, so a caller reading only ``.text`` got empty completions for every prompt."""
    base = LLM(tiny_model["model_dir"], dtype="float32")
    lora = LoRARequest("a0", 1, adapter_dir(tiny_model, 0))
    with pytest.raises(ValueError, match=r"lora_request: .*enable_lora=True"):
        base.generate([{"prompt_token_ids": PROMPT[:10]}] * 2, PARAMS, lora_request=[None, lora])
    assert not base.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="enable_lora"):
        base.engine.add_request("r", PROMPT[:10], PARAMS, lora_request=lora)
    assert not base.engine.has_unfinished_requests()
    out = base.generate({"prompt_token_ids": PROMPT[:10]}, PARAMS)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 10
