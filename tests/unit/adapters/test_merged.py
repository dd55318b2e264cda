"""Single-adapter stretches on merged weights (adapters/merged.py): the merged weights give the base GEMM plus the
adapter's delta for every projection (mixed ranks, stale slot rows past a rank), un-merging restores the
weights bit for bit, the policy (threshold, any other step restores first, a refilled slot is another adapter,
back-off for alternating workloads), and through the engine the kernel path's tokens with the merge really taken."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.adapters.mapping import LoRAStep
from loraplex.adapters.merged import WEIGHT_OF, MergedLoRA
from loraplex.adapters.modules import MODULE_INDEX, PROJ_MODULES, BaseShapes
from loraplex.adapters.slot_pool import SlotPool
from loraplex.engine.models.llama import LlamaConfig, LlamaForCausalLM
from tests.conftest import adapter_dir

SHAPES = BaseShapes(num_layers=2, hidden_size=32, q_size=32, kv_size=16, intermediate_size=48)
RANK = 8


def _model_and_pool(seed: int):
    cfg = LlamaConfig.from_hf({"architectures": ["LlamaForCausalLM"], "hidden_size": 32, "num_attention_heads": 4,
                               "num_key_value_heads": 2, "intermediate_size": 48, "num_hidden_layers": 2,
                               "vocab_size": 64, "rms_norm_eps": 1e-5, "max_position_embeddings": 64})
    model = LlamaForCausalLM(cfg, "cpu", torch.float32)
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    pool = SlotPool(SHAPES, max_loras=3, max_rank=RANK, device="cpu", dtype=torch.float32)
    for t in (*pool.a.values(), *pool.bt.values()):
        t.copy_(torch.randn(t.shape, generator=gen) * 0.3)  # rows past a rank hold stale values: never read
    pool.ranks.copy_(torch.randint(0, RANK + 1, pool.ranks.shape, generator=gen, dtype=torch.int32))
    pool.scaling.copy_(torch.rand(3, generator=gen) + 0.5)
    return model, pool


def _weights(model) -> list[torch.Tensor]:
    return [getattr(layer, name).detach().clone() for layer in model.layers for name in WEIGHT_OF.values()]


@pytest.mark.parametrize("slot", [0, 1, 2])
def test_merged_weights_give_the_base_gemm_plus_the_delta_and_unmerge_is_exact(slot):
    model, pool = _model_and_pool(seed=slot)
    before = _weights(model)
    merged = MergedLoRA(model, pool)
    tokens = torch.tensor([slot] * 5, dtype=torch.int32)
    reference = LoRAStep(pool, tokens, 1, use_triton=False)
    gen = torch.Generator().manual_seed(7)
    xs = {(i, p): torch.randn(5, getattr(layer, WEIGHT_OF[p]).shape[1], generator=gen)
          for i, layer in enumerate(model.layers) for p in PROJ_MODULES}
    want = {(i, p): reference.add(i, p, x, F.linear(x, getattr(model.layers[i], WEIGHT_OF[p])))
            for (i, p), x in xs.items()}
    merged.merge(slot)
    for (i, p), x in xs.items():
        weight = getattr(model.layers[i], WEIGHT_OF[p])
        got = F.linear(x, weight)
        torch.testing.assert_close(got, want[i, p], rtol=1e-5, atol=1e-5)
        lo = MODULE_INDEX[PROJ_MODULES[p][0]]
        if pool.ranks[i, lo:lo + len(PROJ_MODULES[p]), slot].sum() > 0:  # the adapter targets it: it changed
            assert not torch.allclose(got, F.linear(x, merged.pristine[p][i]), atol=1e-3), (i, p)
    merged.unmerge()
    for w0, w in zip(before, _weights(model)):
        assert torch.equal(w0, w)  # bit for bit


def test_policy_threshold_restore_refill_and_back_off():
    model, pool = _model_and_pool(seed=3)
    before = _weights(model)
    merged = MergedLoRA(model, pool, min_steps=3, max_steps=12)
    one = {5: 1}
    assert [merged.step(one, has_base=False) for _ in range(4)] == [False, False, True, True]
    assert merged.merged == (1, pool.fill_version[1]) and merged.num_merges == 1
    # base tokens beside the adapter's: restored first, the step runs on the kernels
    assert not merged.step(one, has_base=True)
    assert merged.merged is None and merged.num_unmerges == 1
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(model)))
    # held 2 steps < threshold 3: the threshold doubled
    assert merged.threshold == 6
    for _ in range(5):
        assert not merged.step(one, has_base=False)
    assert merged.step(one, has_base=False)  # the 6th in a row
    # a refilled slot is another adapter: restored, counted afresh
    pool.fill_version[1] += 1
    assert not merged.step(one, has_base=False) and merged.merged is None
    assert merged.threshold == 12  # held 1 step
    for step in (None, {}, {5: 1, 6: 2}):  # no adapter, an empty map, two adapters: never merged
        for _ in range(20):
            assert not merged.step(step, has_base=step is None)
    # a long merge halves the threshold again when it ends
    for _ in range(12 + 48):
        merged.step({7: 2}, has_base=False)
    assert merged.merged is not None and merged.num_merges == 3
    merged.step(None, has_base=True)
    assert merged.threshold == 6 and merged.num_unmerges == 3
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(model)))


def test_bad_thresholds_are_refused():
    model, pool = _model_and_pool(seed=1)
    with pytest.raises(ValueError, match="min_steps"):
        MergedLoRA(model, pool, min_steps=0)
    with pytest.raises(ValueError, match="merge_single_lora needs enable_lora"):
        from loraplex.engine.config import EngineConfig

        EngineConfig(model="m", merge_single_lora=True)


def test_engine_merged_steps_give_the_kernel_path_tokens(tiny_model):
    loras = [LoRARequest(f"a{i}", i + 1, adapter_dir(tiny_model, i)) for i in range(2)]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=1)
    prompts = [{"prompt_token_ids": [1] + list(range(20 + i, 31 + 2 * i))} for i in range(5)]
    # one adapter alone, then base requests beside it (restored), then the other adapter alone, then base alone
    mixes = [[loras[0]] * 5, [loras[0], None, loras[0], loras[0], None], [loras[1]] * 5, [None] * 5]

    def run(merge: bool):
        llm = LLM(tiny_model["model_dir"], dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=64,
                  merge_single_lora=merge)
        if merge:
            merged = llm.engine.runner.get_lora_manager().merged
            merged.min_steps = merged.threshold = 2  # merge within this short run
        outs = [llm.generate(prompts, params, lora_request=m) for m in mixes]
        return llm, [[(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob) for o in out] for out in outs]

    _, want = run(False)
    llm, got = run(True)
    for w_batch, g_batch in zip(want, got):
        for (w_ids, w_lp), (g_ids, g_lp) in zip(w_batch, g_batch):
            assert g_ids == w_ids
            assert abs(g_lp - w_lp) < 1e-3
    merged = llm.engine.runner.lora_manager.merged
    assert merged.num_merges >= 2 and merged.num_merged_steps >= 2 * 8  # both adapters' batches ran merged
    assert merged.merged is None  # the base batch restored the weights
    counters = llm.engine.counters
    assert (counters["lora_merges"], counters["lora_merged_steps"]) == (merged.num_merges, merged.num_merged_steps)
    stats = llm.engine.get_stats()
    assert (stats.num_lora_merges, stats.num_lora_merged_steps) == (merged.num_merges, merged.num_merged_steps)
    assert all(torch.equal(merged.pristine[p][i], getattr(layer, WEIGHT_OF[p]))
               for i, layer in enumerate(llm.engine.runner.model.layers) for p in WEIGHT_OF)
    # and the adapters matter here: the base model's tokens differ
    assert want[0][0][0] != want[3][0][0]


def test_a_long_prompt_step_merges_at_once_and_decode_steps_wait_for_the_threshold():
    model, pool = _model_and_pool(seed=4)
    merged = MergedLoRA(model, pool, min_steps=8, tokens_per_step=512)
    assert merged.step({3: 0}, has_base=False, num_tokens=4096)  # 8 * 512 tokens in its first step
    merged.step(None, has_base=True)
    merged.threshold = 8
    assert [merged.step({3: 0}, has_base=False, num_tokens=64) for _ in range(8)] == [False] * 7 + [True]


def test_a_copy_that_does_not_fit_is_refused_with_the_sizes():
    from loraplex.adapters.merged import check_room

    check_room(need=3 << 30, free=5 << 30)
    with pytest.raises(ValueError, match=r"merge_single_lora keeps a copy .* 14.0 GiB .* 12.0 GiB free"):
        check_room(need=14 << 30, free=12 << 30)
