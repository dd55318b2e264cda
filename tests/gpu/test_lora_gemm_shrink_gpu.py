"""``lora_gemm_shrink`` on CUDA: with every slot's A rows folded under the base weights, one cuBLAS GEMM gives each
projection's base output and every slot's y, then the expand reads each token's own slot's y (bf16: y is rounded by
the GEMM, as the usual expand rounds it before its product, but accumulated in another order).

fp32: equal to the usual order (base GEMM, shrink, expand) within fp32 noise, eagerly and under CUDA-graph replay
with other adapter mixes than at capture. bf16: at least as close to an fp32 reference as the usual order is."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.test_lora_expand_first_gpu import (
    _upcast,
    as_accurate_as_the_usual_order,
    equals_the_usual_order_eager_and_under_graph_replay,
)
from tests.gpu.test_lora_overlap_gpu import PROJS, _setup

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _fold(pool, weights, num_layers):
    """The base weights folded with the pool's A rows; returns the per-layer views the model would use."""
    views = {p: pool.fold_base_weights(p, [weights[i][p] for i in range(num_layers)]) for p in PROJS}
    return [{p: views[p][i] for p in PROJS} for i in range(num_layers)]


def _gemm_shrink(slots) -> dict:
    return {"gemm_shrink": True}


def test_gemm_shrink_fp32_equals_the_usual_order_eager_and_under_graph_replay():
    setup = _setup(torch.float32)
    weights = _fold(setup[1], setup[2], setup[0].num_layers)
    equals_the_usual_order_eager_and_under_graph_replay(setup, weights, 5, "gemm_shrink", {"gemm_shrink": True},
                                                        _gemm_shrink)


def test_gemm_shrink_bf16_is_as_accurate_as_the_usual_order():
    setup = _setup(torch.bfloat16)
    pool32, w32 = _upcast(setup[1]), [{p: w.float() for p, w in d.items()} for d in setup[2]]
    weights = _fold(setup[1], setup[2], setup[0].num_layers)
    as_accurate_as_the_usual_order(setup, weights, pool32, w32, 6, _gemm_shrink)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_with_gemm_shrink_matches_the_usual_order(tiny_model, dtype):
    """The engine option end to end on CUDA graphs: three adapters on four slots, so decode steps take the in-GEMM
    shrink (their own graph variant); tokens and logprobs as without it (bf16: up to real near-ties)."""
    from loraplex.engine.cuda_graphs import GemmShrink
    from tests.gpu.test_cuda_graphs import _compare, generate_with, mixed_requests

    requests = mixed_requests(tiny_model, seed=12)
    _, usual = generate_with(tiny_model, dtype, requests)
    llm, got = generate_with(tiny_model, dtype, requests, lora_gemm_shrink=True)
    runner = llm.engine.runner
    assert set(runner.lora_manager.pool.folded) == {"qkv", "o", "gate_up", "down"}
    assert any(isinstance(key[1], GemmShrink) for key in runner.graphs.used_keys)
    assert _compare(usual, got, dtype) >= (40 * 12 if dtype == "float32" else 0.5 * 40 * 12)


def test_engine_moves_adapters_below_the_width_under_graph_replay(tiny_model):
    """fp32, CUDA graphs, 16 slots: six adapters fill slots 0-5 and three others (on other files) slots 6-8, by
    one-token requests (prompt steps only, which move nothing). Decoding on the three, the first decode step's copies
    on the device swap them into slots 0-2 before its graph replays over 4 slots; a last round runs the swapped-out
    adapters from their new slots. Tokens and logprobs as without the in-GEMM shrink."""
    from loraplex import LLM, LoRARequest, SamplingParams
    from tests.conftest import adapter_dir
    from tests.gpu.test_cuda_graphs import _compare

    first = [LoRARequest(f"a{i}", i + 1, adapter_dir(tiny_model, i)) for i in range(6)]
    later = [LoRARequest(f"b{i}", 7 + i, adapter_dir(tiny_model, 3 + i)) for i in range(3)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    one_token = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    gen = torch.Generator().manual_seed(5)

    def prompts(n: int):
        return [{"prompt_token_ids": [1] + torch.randint(8, 500, (int(torch.randint(2, 60, (1,), generator=gen)),),
                                                         generator=gen).tolist()} for _ in range(n)]

    rounds = [(prompts(8), [later[i % 3] for i in range(7)] + [None]), (prompts(6), first[:3] * 2)]
    kw = dict(device="cuda", dtype="float32", enable_lora=True, max_loras=16, max_lora_rank=64, max_num_seqs=64)
    plain = LLM(tiny_model["model_dir"], **kw)
    want = [o for p, m in rounds for o in plain.generate(p, params, lora_request=m)]
    llm = LLM(tiny_model["model_dir"], lora_gemm_shrink=True, **kw)
    manager = llm.engine.runner.lora_manager
    llm.generate(prompts(6), one_token, lora_request=first)
    llm.generate(prompts(3), one_token, lora_request=later)
    assert sorted(manager._slot_of[a] for a in (7, 8, 9)) == [6, 7, 8] and manager.num_slot_moves == 0
    got = llm.generate(rounds[0][0], params, lora_request=rounds[0][1])
    assert manager.num_slot_moves == 3 and sorted(manager._slot_of[a] for a in (7, 8, 9)) == [0, 1, 2]
    got += llm.generate(rounds[1][0], params, lora_request=rounds[1][1])
    assert manager.num_gemm_shrink_steps > 0 and llm.engine.runner.graphs.num_replays > 0
    assert _compare(want, got, "float32") == 12 * len(want)
