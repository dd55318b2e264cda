"""The one-launch ticketed LoRA kernel on the GPU: its programs run concurrently, so here the expand programs really
wait on the shrink programs' counts (under the interpreter they never have to)."""

from __future__ import annotations

import dataclasses
import importlib
import os

import pytest
import torch

from loraplex.kernels import lora_expand, lora_meta, lora_ops, lora_shrink, lora_ticketed
from loraplex.kernels.lora_meta import build_lora_meta
from loraplex.kernels.lora_ops import choose_config, lora_apply
from loraplex.kernels.lora_ref import lora_apply_ref
from loraplex.kernels.lora_testing import (
    LLAMA3_GROUPS,
    capture_cuda_graph,
    decode_mix_slots,
    make_lora_batch,
    random_slot_pool,
    token_slots_for,
)

BF16_TOL = dict(rtol=3e-2, atol=2e-2)
MODULES = (lora_meta, lora_shrink, lora_expand, lora_ticketed, lora_ops)


@pytest.fixture(scope="module", autouse=True)
def compiled_kernels():
    """The unit kernel tests set TRITON_INTERPRET=1 in this process; these tests need compiled kernels."""
    saved = os.environ.pop("TRITON_INTERPRET", None)
    from triton.runtime.interpreter import InterpretedFunction

    interpreted = isinstance(lora_ticketed._lora_ticketed_kernel, InterpretedFunction)
    if interpreted:
        for module in MODULES:
            importlib.reload(module)
    yield
    if saved is not None:
        os.environ["TRITON_INTERPRET"] = saved
    if interpreted:
        for module in MODULES:
            importlib.reload(module)


def _reference(batch):
    ref = lora_apply_ref(batch.x.float(), batch.out.float(), batch.lora_a.float(), batch.lora_b.float(),
                         batch.token_slots, batch.ranks, batch.scaling, batch.slice_loc)
    return ref.to(batch.out.dtype)


def _configs(batch, num_active: int):
    """The engine's decode configuration (PDL where the GPU has it), two-launch and ticketed with the same warps (so
    both run the same programs with the same layouts: their results must agree bit for bit)."""
    from loraplex.kernels.lora_shrink import pdl_supported

    cfg = choose_config(batch.x.shape[0], num_active, batch.lora_a.shape[0], batch.lora_a.shape[2], batch.x.shape[1],
                        len(batch.slice_loc) - 1, batch.max_slice_width, pdl=pdl_supported(batch.x.device))
    two = dataclasses.replace(cfg, ticketed=False, shrink_warps=4, expand_warps=4)
    return two, dataclasses.replace(two, ticketed=True, ticket_warps=4)


def _launch(batch, cfg, meta, counters, chunk_ranks):
    out = batch.out.clone()
    lora_apply(batch.x, out, batch.lora_a, batch.lora_b, batch.ranks, batch.scaling, batch.slice_loc,
               batch.max_slice_width, meta, cfg, counters=counters, chunk_ranks=chunk_ranks)
    return out


@pytest.mark.parametrize("proj", list(LLAMA3_GROUPS))
@pytest.mark.parametrize("mix", ["distinct", "identical", "eight", "skewed"])
def test_ticketed_llama3_decode_bf16_equals_two_launches(proj, mix):
    """64 tokens, tiles planned for 64 distinct adapters (as the decode CUDA graph), mixed real ranks below the
    pool's 32 (two rank tiles of 16 where the rank is above 16), some base rows: bit-identical to the two-launch
    path, the fp32 twin's within bf16 tolerance, the same bits on 20 repeated launches (a read of y before its last
    partial would move them), every counter back at 0 and no miscount."""
    k_dim, widths = LLAMA3_GROUPS[proj]
    gen = torch.Generator().manual_seed(len(proj) + len(mix))
    slots = decode_mix_slots(mix, gen)
    ranks = torch.tensor([16, 8, 32, 24])[torch.randint(0, 4, (len(widths), 64), generator=gen)].tolist()
    batch = make_lora_batch(64, k_dim, widths, num_slots=64, max_rank=32, slot_ranks=ranks, dtype=torch.bfloat16,
                            device="cuda", token_slots=slots)
    two, ticketed = _configs(batch, 64)
    meta = build_lora_meta(batch.token_slots, 64, two.block_m)
    chunk_ranks = batch.ranks.index_select(1, meta.chunk_slots.clamp(min=0))
    counters = torch.zeros(lora_ticketed.counters_size(meta.max_chunks, 3), dtype=torch.int32, device="cuda")
    want = _launch(batch, two, meta, None, chunk_ranks)
    outs = [_launch(batch, ticketed, meta, counters, chunk_ranks) for _ in range(20)]
    torch.cuda.synchronize()
    assert not counters.any(), "every launch leaves its counters at 0; no pair was found above its count"
    for out in outs:
        assert torch.equal(out, want)
    base = batch.token_slots < 0
    assert torch.equal(outs[0][base], batch.out[base])
    torch.testing.assert_close(outs[0].float(), _reference(batch).float(), **BF16_TOL)


def test_ticketed_chain_under_cuda_graph_replay(monkeypatch):
    """As the engine's decode graph with LORAPLEX_LORA_TICKETED=1: LoRAStep picks the ticketed kernel for every
    projection; a chain of layers where each launch reads the previous one's output, captured once (PDL on Hopper)
    and replayed for other adapter mixes: bit-identical to the same chain on the two-launch path, eagerly."""
    from loraplex.adapters.mapping import LoRAStep
    from loraplex.adapters.modules import BaseShapes

    monkeypatch.setattr(lora_ops, "TICKETED_DECODE", True)
    shapes = BaseShapes(num_layers=6, hidden_size=512, q_size=512, kv_size=128, intermediate_size=1024)
    num_tokens, slots_n = 48, 16
    pool, gen = random_slot_pool(shapes, slots_n, 16, "cuda", torch.bfloat16)
    slots_buf = torch.full((num_tokens,), -1, dtype=torch.int32, device="cuda")
    x0 = torch.randn(num_tokens, 512, generator=gen, device="cuda").to(torch.bfloat16)
    bases = [torch.randn(num_tokens, 512, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(6)]
    outs = [torch.empty_like(b) for b in bases]
    steps = []

    def chain(step):
        for out, base in zip(outs, bases):
            out.copy_(base)
        x = x0
        for layer, out in enumerate(outs):
            step.add(layer, "o", x, out)
            x = out

    def graph_step():
        step = LoRAStep(pool, slots_buf, min(num_tokens, slots_n), use_triton=True)
        assert all(c.ticketed for c in step._configs.values()) and step._counters is not None
        steps.append(step)
        chain(step)

    graph = capture_cuda_graph(graph_step)
    cpu_gen = torch.Generator().manual_seed(1)
    for mix in ("identical", "distinct", "zipf", "skewed", "distinct"):
        slots_buf.copy_(token_slots_for(mix, num_tokens, slots_n, cpu_gen).cuda())
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        got = [o.clone() for o in outs]
        assert not steps[-1]._counters.any(), mix
        eager = LoRAStep(pool, slots_buf, min(num_tokens, slots_n), use_triton=True)
        eager._configs = {p: dataclasses.replace(c, ticketed=False, shrink_warps=c.ticket_warps,
                                                 expand_warps=c.ticket_warps) for p, c in eager._configs.items()}
        chain(eager)
        torch.cuda.synchronize()
        for a, b in zip(got, outs):
            assert torch.equal(a, b), mix


def test_many_back_to_back_launches_on_one_counters_buffer():
    """400 launches in a row (3-slice and 1-slice projections alternating, as a step's layers) share one counters
    buffer: none waits for ever, all results stay right, the counters end at 0."""
    qkv = make_lora_batch(64, 4096, (4096, 1024, 1024), num_slots=64, max_rank=16, mix="zipf", dtype=torch.bfloat16,
                          device="cuda", seed=2)
    down = make_lora_batch(64, 14336, (4096,), num_slots=64, max_rank=16, dtype=torch.bfloat16, device="cuda", seed=4,
                           token_slots=qkv.token_slots.cpu())
    cfgs = {id(b): _configs(b, 64)[1] for b in (qkv, down)}
    meta = build_lora_meta(qkv.token_slots, 64, 16)
    counters = torch.zeros(lora_ticketed.counters_size(meta.max_chunks, 3), dtype=torch.int32, device="cuda")
    results = {id(b): [] for b in (qkv, down)}
    for i in range(400):
        batch = qkv if i % 2 == 0 else down
        results[id(batch)].append(_launch(batch, cfgs[id(batch)], meta, counters, None))
    torch.cuda.synchronize()
    assert not counters.any()
    for batch in (qkv, down):
        first = results[id(batch)][0]
        assert all(torch.equal(first, r) for r in results[id(batch)])
        torch.testing.assert_close(first.float(), _reference(batch).float(), **BF16_TOL)
