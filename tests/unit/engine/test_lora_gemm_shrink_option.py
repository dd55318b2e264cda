"""Engine option ``lora_gemm_shrink`` on the CPU (the twins run the same order as the CUDA kernels): the base weights
are folded with the slot pool's A rows, pure-decode steps whose adapters fill at least half of the slots take the
in-GEMM shrink, other steps the usual path, and the greedy tokens (and logprobs) are those of the usual path. The
kernels themselves are checked on CUDA (tests/gpu/test_lora_gemm_shrink_gpu.py)."""

from __future__ import annotations

import pytest

from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.adapters.manager import GEMM_SHRINK_MAX_WORK, gemm_shrink_widths
from loraplex.engine.config import EngineConfig
from tests.conftest import adapter_dir


def test_gemm_shrink_folds_the_weights_and_decodes_the_same_tokens(tiny_model, lora_steps):
    assert EngineConfig(model="m").lora_gemm_shrink is False
    with pytest.raises(ValueError, match="lora_gemm_shrink_max_tokens must be >= 1"):
        EngineConfig(model="m", lora_gemm_shrink_max_tokens=0).resolve(tiny_model["model_dir"])
    loras = [LoRARequest(f"a{i}", i + 1, adapter_dir(tiny_model, i)) for i in range(3)]
    mix = [loras[0], None, loras[1], loras[0], loras[2], loras[1]]
    prompts = [{"prompt_token_ids": [1] + [7 + 13 * i + j for j in range(5 + 3 * i)]} for i in range(len(mix))]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0)
    steps = lora_steps
    kw = dict(dtype="float32", enable_lora=True, max_loras=4, max_num_seqs=8)
    want = LLM(tiny_model["model_dir"], **kw).generate(prompts, params, lora_request=mix)
    assert not any(s.gemm_shrink for s in steps)
    llm = LLM(tiny_model["model_dir"], lora_gemm_shrink=True, **kw)
    runner = llm.engine.runner
    manager = runner.lora_manager
    assert set(manager.pool.folded) == {"qkv", "o", "gate_up", "down"} and manager.gemm_shrink_max_tokens == 64
    for layer_idx, layer in enumerate(runner.model.layers):  # the model's weights are views of the folded tensors
        assert layer.qkv_weight.data_ptr() == manager.pool.folded["qkv"][0][layer_idx].data_ptr()
        assert layer.down_weight.data_ptr() == manager.pool.folded["down"][0][layer_idx].data_ptr()
    assert manager.gemm_shrink_width(6, [0, 1]) == 4 and manager.gemm_shrink_width(6, [2]) is None
    assert manager.gemm_shrink_width(65, [0, 1, 2, 3]) is None  # above lora_gemm_shrink_max_tokens
    steps.clear()
    got = llm.generate(prompts, params, lora_request=mix)
    used = [s for s in steps if s.gemm_shrink]
    assert used and any(s.num_active and not s.gemm_shrink for s in steps)  # decode steps in it, prompt steps not
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for lg, lw in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            tok = next(iter(lw))
            assert abs(lg[tok].logprob - lw[tok].logprob) < 1e-4


def test_gemm_shrink_is_left_off_where_no_step_could_use_it(tiny_model):
    """No GEMM width (4 slots at the least) that the largest decode step the option may take could fill half of: no
    weights folded, no step takes it."""
    llm = LLM(tiny_model["model_dir"], dtype="float32", enable_lora=True, max_loras=8, max_num_seqs=8,
              lora_gemm_shrink=True, lora_gemm_shrink_max_tokens=1)
    manager = llm.engine.runner.lora_manager
    assert not manager.pool.folded and not manager.gemm_shrink_widths(1) and manager.gemm_shrink_width(1, [0]) is None


def test_gemm_shrink_folds_through_host_memory_when_the_device_is_short(tiny_model, monkeypatch):
    """Where the folded tensor would not fit beside the weights, the weights wait in host memory while folding: the
    model ends with views of the folded tensors on the engine's device and generates the same tokens."""
    from loraplex.engine.model_runner import ModelRunner

    staged = []
    monkeypatch.setattr(ModelRunner, "_stage_before_fold", lambda self, proj, weights: staged.append(proj) or True)
    loras = [LoRARequest(f"a{i}", i + 1, adapter_dir(tiny_model, i)) for i in range(2)]
    prompts = [{"prompt_token_ids": [1, 9 + i, 30, 31 + i]} for i in range(4)]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    mix = [loras[0], loras[1], None, loras[0]]
    kw = dict(dtype="float32", enable_lora=True, max_loras=4, max_num_seqs=8)
    want = LLM(tiny_model["model_dir"], **kw).generate(prompts, params, lora_request=mix)
    llm = LLM(tiny_model["model_dir"], lora_gemm_shrink=True, **kw)
    runner = llm.engine.runner
    assert staged == ["qkv", "o", "gate_up", "down"]
    for layer_idx, layer in enumerate(runner.model.layers):
        assert layer.gate_up_weight.data_ptr() == runner.lora_manager.pool.folded["gate_up"][0][layer_idx].data_ptr()
    got = llm.generate(prompts, params, lora_request=mix)
    assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]


def test_gemm_shrink_widths_follow_the_rows_and_the_work_bound():
    # 248 x 128 > 128 x 128: compute-bound, not taken; above 128 rows at most 32 slots (248 x 64 lost on the H200)
    assert gemm_shrink_widths(256, 248) == (4, 8, 16, 32) and gemm_shrink_widths(256, 129) == (4, 8, 16, 32)
    assert gemm_shrink_widths(256, 64) == (4, 8, 16, 32, 64, 128)  # at most twice the rows
    assert gemm_shrink_widths(256, 128) == (4, 8, 16, 32, 64, 128)
    assert gemm_shrink_widths(48, 64) == (4, 8, 16, 32, 48)  # the pool's own size closes the ladder
    assert gemm_shrink_widths(3, 8) == (3,) and gemm_shrink_widths(8, 1) == ()
    assert GEMM_SHRINK_MAX_WORK == 128 * 128


def test_gemm_shrink_over_the_first_slots_decodes_the_same_tokens(tiny_model, lora_steps):
    """16 slots, three adapters: they take the lowest slots (0-2), so the decode steps' GEMM computes y for the first
    4 slots only (the narrowest width above the highest slot that three adapters fill half of); the tokens and
    logprobs are the usual path's. Freed slots are given lowest first."""
    loras = [LoRARequest(f"a{i}", i + 1, adapter_dir(tiny_model, i)) for i in range(3)]
    mix = [loras[0], loras[1], loras[2], loras[0], None, loras[1]]
    prompts = [{"prompt_token_ids": [1] + [9 + 11 * i + j for j in range(4 + 2 * i)]} for i in range(len(mix))]
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=0)
    kw = dict(dtype="float32", enable_lora=True, max_loras=16, max_num_seqs=8)
    want = LLM(tiny_model["model_dir"], **kw).generate(prompts, params, lora_request=mix)
    llm = LLM(tiny_model["model_dir"], lora_gemm_shrink=True, **kw)
    manager = llm.engine.runner.lora_manager
    assert manager.pool.folded and manager.gemm_shrink_widths(6) == (4, 8)  # at most twice the rows
    lora_steps.clear()
    got = llm.generate(prompts, params, lora_request=mix)
    assert sorted(manager._slot_of.values()) == [0, 1, 2]
    used = [s for s in lora_steps if s.gemm_shrink]
    assert used and {s.gemm_slots for s in used} == {4}
    assert any(s.num_active and not s.gemm_shrink for s in lora_steps)  # the prompt steps: the usual shrink
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for lg, lw in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            tok = next(iter(lw))
            assert abs(lg[tok].logprob - lw[tok].logprob) < 1e-4
    # a step whose adapters do not fill half of the narrowest width above their highest slot: the usual path
    assert manager.gemm_shrink_width(6, [0, 9]) is None and manager.gemm_shrink_width(6, [0, 1, 2, 5, 6]) == 8
    # freed slots: the lowest is given first (slots 0 and 2 freed, in that order; a stack would give 2)
    by_slot = {slot: adapter for adapter, slot in manager._slot_of.items()}
    manager.remove_adapter(by_slot[0])
    manager.remove_adapter(by_slot[2])
    again = LoRARequest("a0-again", 9, adapter_dir(tiny_model, 0))
    llm.generate(prompts[:1], params, lora_request=[again])
    assert manager._slot_of[9] == 0


def test_decode_steps_move_their_adapters_below_the_width_and_decode_the_same_tokens(tiny_model, lora_steps):
    """Six adapters fill slots 0-5 and three others slots 6-8 (one-token requests: prompt steps only, which move
    nothing). Decoding on the three, the first decode step swaps them into slots 0-2 (``lora_gemm_shrink_max_moves``)
    and the steps take the in-GEMM shrink over 4 slots; tokens and logprobs are the usual path's, there and when the
    swapped-out adapters run again from their new slots."""
    first = [LoRARequest(f"a{i}", i + 1, adapter_dir(tiny_model, i)) for i in range(6)]
    later = [LoRARequest(f"b{i}", 7 + i, adapter_dir(tiny_model, 3 + i)) for i in range(3)]
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=0)
    one_token = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)

    def prompts(n: int, seed: int):
        return [{"prompt_token_ids": [1] + [9 + seed + 7 * i + j for j in range(3 + i)]} for i in range(n)]

    rounds = [(prompts(4, 5), [later[0], later[1], None, later[2]]), (prompts(3, 9), first[:3])]
    kw = dict(dtype="float32", enable_lora=True, max_loras=16, max_num_seqs=8)
    plain = LLM(tiny_model["model_dir"], **kw)
    want = [plain.generate(p, params, lora_request=m) for p, m in rounds]
    llm = LLM(tiny_model["model_dir"], lora_gemm_shrink=True, **kw)
    manager = llm.engine.runner.lora_manager
    assert manager.gemm_shrink_max_moves == 8
    llm.generate(prompts(6, 0), one_token, lora_request=first)
    llm.generate(prompts(3, 2), one_token, lora_request=later)
    assert sorted(manager._slot_of[a] for a in range(1, 7)) == list(range(6))
    assert sorted(manager._slot_of[a] for a in (7, 8, 9)) == [6, 7, 8] and manager.num_slot_moves == 0
    lora_steps.clear()
    got = [llm.generate(rounds[0][0], params, lora_request=rounds[0][1])]
    assert manager.num_slot_moves == 3 and sorted(manager._slot_of[a] for a in (7, 8, 9)) == [0, 1, 2]
    assert {s.gemm_slots for s in lora_steps if s.gemm_shrink} == {4}
    got.append(llm.generate(rounds[1][0], params, lora_request=rounds[1][1]))
    for g_round, w_round in zip(got, want):
        for g, w in zip(g_round, w_round):
            assert g.outputs[0].token_ids == w.outputs[0].token_ids
            for lg, lw in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
                tok = next(iter(lw))
                assert abs(lg[tok].logprob - lw[tok].logprob) < 1e-4
