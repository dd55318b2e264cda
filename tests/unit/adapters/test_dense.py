"""Single-adapter steps as one GEMM (adapters/dense.py): the same result as the base GEMM plus the adapter's
delta, for every projection, mixed ranks, base tokens beside adapter tokens and stale slot rows past a rank;
and through the engine, the tokens of PEFT with the adapter alone, with the path really taken."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.adapters.dense import WEIGHT_OF, DenseLoRA, lora_pad
from loraplex.adapters.mapping import LoRAStep
from loraplex.adapters.modules import MODULE_INDEX, PROJ_MODULES, BaseShapes
from loraplex.adapters.slot_pool import SlotPool
from loraplex.engine.models.llama import LlamaConfig, LlamaForCausalLM
from tests.conftest import adapter_dir

SHAPES = BaseShapes(num_layers=2, hidden_size=32, q_size=32, kv_size=16, intermediate_size=48)
RANK = 8


def _model_and_pool(seed: int):
    cfg = LlamaConfig.from_hf({"architectures": ["LlamaForCausalLM"], "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
                               "intermediate_size": 48, "num_hidden_layers": 2, "vocab_size": 64,
                               "rms_norm_eps": 1e-5, "max_position_embeddings": 64})
    model = LlamaForCausalLM(cfg, "cpu", torch.float32, lora_pad=lora_pad(RANK))
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    pool = SlotPool(SHAPES, max_loras=3, max_rank=RANK, device="cpu", dtype=torch.float32)
    for t in (*pool.a.values(), *pool.bt.values()):
        t.copy_(torch.randn(t.shape, generator=gen) * 0.3)  # rows past a rank hold stale values: never read
    pool.ranks.copy_(torch.randint(0, RANK + 1, pool.ranks.shape, generator=gen, dtype=torch.int32))
    pool.scaling.copy_(torch.rand(3, generator=gen) + 0.5)
    return model, pool


@pytest.mark.parametrize("slot, has_base", [(0, True), (2, True), (1, False)])
def test_dense_linear_equals_base_gemm_plus_delta(slot, has_base):
    model, pool = _model_and_pool(seed=slot)
    dense = DenseLoRA(model, pool, min_steps_between=0)
    gen = torch.Generator().manual_seed(7)
    # base tokens beside the adapter's (masked), or the adapter's alone (no mask: y written straight in)
    tokens = torch.tensor([slot, -1, slot, slot, -1] if has_base else [slot] * 4, dtype=torch.int32)
    reference = LoRAStep(pool, tokens, 1, use_triton=False)
    assert dense.want(slot) and dense.num_layouts == 1
    step = LoRAStep(pool, tokens, 1, use_triton=False, dense=dense, has_base=has_base)
    for layer_idx, layer in enumerate(model.layers):
        for proj in PROJ_MODULES:
            weight = getattr(layer, WEIGHT_OF[proj])
            x = torch.randn(len(tokens), weight.shape[1], generator=gen)
            want = reference.add(layer_idx, proj, x, F.linear(x, weight))
            got = step.linear(layer_idx, proj, x, weight)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            if has_base:
                assert torch.allclose(got[tokens < 0], F.linear(x[tokens < 0], weight), rtol=1e-5, atol=1e-5)
            lo = MODULE_INDEX[PROJ_MODULES[proj][0]]
            if pool.ranks[layer_idx, lo:lo + len(PROJ_MODULES[proj]), slot].sum() > 0:  # the adapter targets it
                assert not torch.allclose(got[tokens >= 0], F.linear(x[tokens >= 0], weight), atol=1e-3), proj


def test_a_refilled_slot_is_laid_out_again_and_switches_are_rate_limited():
    model, pool = _model_and_pool(seed=3)
    dense = DenseLoRA(model, pool, min_steps_between=4)
    assert dense.want(1) and dense.num_layouts == 1
    assert dense.want(1) and dense.num_layouts == 1  # laid out already
    assert not dense.want(2)  # another adapter 2 steps after the last layout: the kernel path this step
    pool.fill_version[1] += 1  # the slot was refilled (another adapter): its layout is stale
    assert not dense.want(1)
    for _ in range(3):
        dense.want(0)
    assert dense.slot == 0 and dense.num_layouts == 2


def test_engine_dense_path_gives_the_kernel_path_tokens(tiny_model):
    loras = [LoRARequest(f"a{i}", i + 1, adapter_dir(tiny_model, i)) for i in range(2)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1)
    prompts = [{"prompt_token_ids": [1] + list(range(20 + i, 31 + 2 * i))} for i in range(5)]
    # one adapter with base requests beside it, then the other adapter alone
    mix = [[loras[0], None, loras[0], loras[0], None], [loras[1]] * 5]

    def run(dense: bool):
        llm = LLM(tiny_model["model_dir"], dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=64,
                  dense_single_lora=dense)
        if dense:
            llm.engine.runner.get_lora_manager().dense.min_steps_between = 2  # switch within this short run
        outs = [llm.generate(prompts, params, lora_request=m) for m in mix]
        return llm, [[(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob) for o in out] for out in outs]

    _, want = run(False)
    llm, got = run(True)
    for w_batch, g_batch in zip(want, got):
        for (w_ids, w_lp), (g_ids, g_lp) in zip(w_batch, g_batch):
            assert g_ids == w_ids
            assert abs(g_lp - w_lp) < 1e-3
    dense = llm.engine.runner.lora_manager.dense
    assert dense is not None and dense.num_layouts == 2  # both adapters went through the dense path
    assert dense.num_dense_steps >= 12
    # qkv, gate|up and down of every layer had x written into the wide input by its producer (o copies it)
    layers = len(llm.engine.runner.model.layers)
    assert dense.num_inputs_in_place == 3 * layers * dense.num_dense_steps
    # and the adapters matter here: the base model's tokens differ
    base = LLM(tiny_model["model_dir"], dtype="float32").generate(prompts[:1], params)
    assert base[0].outputs[0].token_ids != want[0][0][0]
