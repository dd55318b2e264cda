"""Compiled Triton LoRA kernels on CUDA (bf16 and fp32) against the fp32 twins; CUDA-graph replay."""

from __future__ import annotations

import dataclasses
import importlib
import os

import pytest
import torch

from loraplex.kernels import lora_expand, lora_fused, lora_meta, lora_shrink
from loraplex.kernels.lora_meta import build_lora_meta
from loraplex.kernels.lora_ops import choose_config, lora_apply
from loraplex.kernels.lora_ref import lora_apply_ref
from loraplex.kernels.lora_testing import (
    LLAMA3_GROUPS,
    MIXES,
    capture_cuda_graph,
    decode_mix_slots,
    make_lora_batch,
    random_slot_pool,
    token_slots_for,
)

TOL = {torch.bfloat16: dict(rtol=3e-2, atol=2e-2), torch.float32: dict(rtol=1e-4, atol=1e-4)}
QKV = (4096 // 8, 1024 // 8, 1024 // 8)  # Llama-3 q|k|v widths, scaled down


@pytest.fixture(scope="module", autouse=True)
def compiled_kernels():
    """The unit kernel tests set TRITON_INTERPRET=1 in this process; these tests need compiled kernels."""
    saved = os.environ.pop("TRITON_INTERPRET", None)
    from triton.runtime.interpreter import InterpretedFunction

    interpreted = isinstance(lora_shrink._lora_shrink_kernel, InterpretedFunction)
    if interpreted:
        for module in (lora_meta, lora_shrink, lora_expand, lora_fused):
            importlib.reload(module)
    yield
    if saved is not None:
        os.environ["TRITON_INTERPRET"] = saved
    if interpreted:
        for module in (lora_meta, lora_shrink, lora_expand, lora_fused):
            importlib.reload(module)


def _reference(batch):
    # the twin in fp32 on the same (rounded) weights; the output is cast back like the kernel's
    ref = lora_apply_ref(batch.x.float(), batch.out.float(), batch.lora_a.float(), batch.lora_b.float(),
                         batch.token_slots, batch.ranks, batch.scaling, batch.slice_loc)
    return ref.to(batch.out.dtype)


def _apply(batch, num_active, weight_prefetch=None):
    """As LoRAStep launches: programmatic dependent launch where the GPU has it (sm_90+), per-chunk rank and token
    tables (one metadata round trip per program)."""
    from loraplex.kernels.lora_shrink import pdl_supported

    k_dim = batch.x.shape[1]
    cfg = choose_config(batch.x.shape[0], num_active, batch.lora_a.shape[0], batch.lora_a.shape[2], k_dim,
                        len(batch.slice_loc) - 1, batch.max_slice_width, pdl=pdl_supported(batch.x.device))
    if weight_prefetch is not None:
        cfg = dataclasses.replace(cfg, weight_prefetch=weight_prefetch)
    meta = build_lora_meta(batch.token_slots, batch.lora_a.shape[0], cfg.block_m)
    chunk_ranks = batch.ranks.index_select(1, meta.chunk_slots.clamp(min=0))
    out = batch.out.clone()
    lora_apply(batch.x, out, batch.lora_a, batch.lora_b, batch.ranks, batch.scaling, batch.slice_loc,
               batch.max_slice_width, meta, cfg, chunk_ranks=chunk_ranks)
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("max_rank", [8, 16, 32, 64, 24])
@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize("num_tokens", [1, 7, 133, 2048, 4096])  # 4,096: the prefill tiles (PREFILL_TILES_MIN_TOKENS)
def test_against_twin(num_tokens, mix, max_rank, dtype):
    batch = make_lora_batch(num_tokens, 512 + 8, QKV, num_slots=16, max_rank=max_rank, mix=mix, dtype=dtype,
                            device="cuda", seed=num_tokens + max_rank)
    if num_tokens == 1:
        batch.token_slots[0] = 5
    out = _apply(batch, num_active=16)
    base = batch.token_slots < 0
    assert torch.equal(out[base], batch.out[base])
    torch.testing.assert_close(out.float(), _reference(batch).float(), **TOL[dtype])


def test_llama3_decode_shapes_bf16():
    batch = make_lora_batch(64, 4096, (4096, 1024, 1024), num_slots=64, max_rank=16, dtype=torch.bfloat16,
                            device="cuda", token_slots=torch.arange(64, dtype=torch.int32))
    out = _apply(batch, num_active=64)
    torch.testing.assert_close(out.float(), _reference(batch).float(), **TOL[torch.bfloat16])


def test_cuda_graph_replay_with_another_batch():
    gen = torch.Generator().manual_seed(0)
    batch = make_lora_batch(48, 520, QKV, num_slots=8, max_rank=32, mix="zipf", dtype=torch.bfloat16,
                            device="cuda", seed=1)
    width = batch.max_slice_width  # a host copy: never inside the capture
    cfg = choose_config(48, 8, 8, 32, 520, max_slice_width=width)
    slots_buf = batch.token_slots.clone()
    out = batch.out.clone()

    def step():
        out.copy_(batch.out)
        meta = build_lora_meta(slots_buf, 8, cfg.block_m)
        lora_apply(batch.x, out, batch.lora_a, batch.lora_b, batch.ranks, batch.scaling, batch.slice_loc,
                   width, meta, cfg)

    graph = capture_cuda_graph(step)  # warm-up compiles outside the capture
    for mix in ("identical", "distinct", "skewed"):  # other mixes than at capture
        slots_buf.copy_(token_slots_for(mix, 48, 8, gen).cuda())
        graph.replay()
        torch.cuda.synchronize()
        batch.token_slots = slots_buf.clone()
        torch.testing.assert_close(out.float(), _reference(batch).float(), **TOL[torch.bfloat16])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_manager_triton_path_matches_cpu_twin_path(tiny_model, dtype):
    """LoRAManager on CUDA (Triton kernels) against the same manager on the CPU (reference twins)."""
    from transformers import AutoConfig

    from loraplex.adapters.manager import LoRAManager
    from loraplex.adapters.modules import PROJ_MODULES
    from loraplex.engine.lora_request import LoRARequest
    from tests.conftest import adapter_dir

    cfg = AutoConfig.from_pretrained(tiny_model["model_dir"])
    managers = {dev: LoRAManager(cfg, max_loras=4, max_lora_rank=64, max_cpu_loras=6, device=dev,
                                 dtype=torch.float32 if dev == "cpu" else dtype) for dev in ("cpu", "cuda")}
    assert managers["cuda"].use_triton and not managers["cpu"].use_triton
    ids = torch.tensor([0, 1, 6, 6, 0, 3, 4, 1, 4, 4, 6, 0, 3], dtype=torch.int64)
    steps = {}
    for dev, mgr in managers.items():
        for i in (0, 2, 3, 5):
            mgr.validate_and_prefetch(LoRARequest(f"a{i}", i + 1, adapter_dir(tiny_model, i)))
        steps[dev] = mgr.prepare_step(ids.to(dev), adapter_ids=[1, 3, 4, 6])
    gen = torch.Generator().manual_seed(0)
    shapes = managers["cpu"].shapes
    tol = TOL[dtype] if dtype == torch.float32 else dict(rtol=3e-2, atol=4e-2)  # bf16 weights, x and output
    for proj in PROJ_MODULES:
        # inputs rounded to the device dtype first, so both paths start from the same values
        x = torch.randn(len(ids), shapes.proj_in(proj), generator=gen).to(dtype).float()
        base = torch.randn(len(ids), sum(shapes.slice_widths(proj)), generator=gen).to(dtype).float()
        for layer in range(shapes.num_layers):
            ref = steps["cpu"].add(layer, proj, x, base.clone())
            out = steps["cuda"].add(layer, proj, x.to("cuda", dtype), base.to("cuda", dtype))
            torch.testing.assert_close(out.float().cpu(), ref, **tol)
            rows = ids == 0
            assert torch.equal(out[rows.cuda()].cpu(), base.to(dtype)[rows])




@pytest.mark.parametrize("proj", list(LLAMA3_GROUPS))
@pytest.mark.parametrize("variant", [dict(split_k=2), dict(split_k=4), dict(split_k=8, block_k=256), dict(n_splits=1),
                                     dict(n_splits=4), dict(n_splits=8, block_n=256),
                                     # the large tiles the decode policy uses (few loop trips per program)
                                     dict(n_splits=2, block_k=1024, block_n=1024, num_warps=8, num_stages=2),
                                     dict(split_k=4, block_k=512, block_n=512, num_warps=4, num_stages=2)])
def test_fused_llama3_decode_bf16(proj, variant):
    """Fused launch on the Llama-3-8B decode shapes, 64 tokens on 64 distinct adapters (mixed real ranks
    below the pool's 32: padding rows are random and must not be read), against the fp32 twin; the
    split-K variants run twice on the same inputs and must agree bit for bit (a race would move them)."""
    k_dim, widths = LLAMA3_GROUPS[proj]
    gen = torch.Generator().manual_seed(len(proj))
    ranks = torch.tensor([16, 8, 32, 24])[torch.randint(0, 4, (len(widths), 64), generator=gen)].tolist()
    batch = make_lora_batch(64, k_dim, widths, num_slots=64, max_rank=32, slot_ranks=ranks, dtype=torch.bfloat16,
                            device="cuda", token_slots=torch.randperm(64, generator=gen).to(torch.int32))
    batch.token_slots[::9] = -1  # some base-model rows
    meta = build_lora_meta(batch.token_slots, 64, 16)
    counters = torch.zeros(meta.max_chunks * len(widths), dtype=torch.int32, device="cuda")
    outs = []
    for _ in range(2):
        out = batch.out.clone()
        lora_fused.lora_fused(batch.x, out, batch.lora_a, batch.lora_b, batch.ranks, batch.scaling, batch.slice_loc,
                              batch.max_slice_width, meta, counters=counters, **variant)
        outs.append(out)
    torch.cuda.synchronize()
    assert not counters.any(), "every ticket counter returns to 0"
    assert torch.equal(outs[0], outs[1])
    base = batch.token_slots < 0
    assert torch.equal(outs[0][base], batch.out[base])
    torch.testing.assert_close(outs[0].float(), _reference(batch).float(), **TOL[torch.bfloat16])


def test_fused_split_k_under_cuda_graph_replay(monkeypatch):
    """The last-arriver counters are shared by all launches of a step and must be reset inside the graph too."""
    from loraplex.kernels import lora_ops

    monkeypatch.setattr(lora_ops, "FUSED_DECODE", True)  # off by default (slower on the H200)
    gen = torch.Generator().manual_seed(3)
    batch = make_lora_batch(32, 14336, (4096,), num_slots=16, max_rank=16, mix="zipf", dtype=torch.bfloat16,
                            device="cuda", seed=3)
    cfg = choose_config(32, 16, 16, 16, 14336, 1, 4096)
    assert cfg.fused and cfg.fused_split_k > 1
    slots_buf = batch.token_slots.clone()
    meta = build_lora_meta(slots_buf, 16, cfg.block_m)  # rebuilt inside the graph below
    counters = torch.zeros(meta.max_chunks, dtype=torch.int32, device="cuda")
    scratch = torch.empty(cfg.fused_split_k, 1, 32, 16, dtype=torch.float32, device="cuda")
    out = batch.out.clone()

    def step():
        out.copy_(batch.out)
        m = build_lora_meta(slots_buf, 16, cfg.block_m)
        for _ in range(3):  # three "layers" on the same counters; only the last result is kept
            out.copy_(batch.out)
            lora_apply(batch.x, out, batch.lora_a, batch.lora_b, batch.ranks, batch.scaling, batch.slice_loc,
                       4096, m, cfg, scratch, counters)

    graph = capture_cuda_graph(step)
    for mix in ("distinct", "identical", "skewed"):
        slots_buf.copy_(token_slots_for(mix, 32, 16, gen).cuda())
        graph.replay()
        torch.cuda.synchronize()
        batch.token_slots = slots_buf.clone()
        torch.testing.assert_close(out.float(), _reference(batch).float(), **TOL[torch.bfloat16])
        assert not counters.any()


@pytest.mark.parametrize("widths", [(4096, 1024, 1024), (14336, 14336), (56, 56), (72, 24)])
@pytest.mark.parametrize("num_tokens, num_active", [(64, 64), (300, 4), (4096, 4)])
def test_expand_column_hint_bf16(widths, num_tokens, num_active):
    """lora_apply with the vectorizing COL_ALIGN hint (as LoRAStep passes it) against the twin, decode and
    prefill regimes, widths that allow 16-, 8- and 8-element alignment."""
    from loraplex.kernels.lora_expand import slice_col_align

    loc = [0]
    for w in widths:
        loc.append(loc[-1] + w)
    gen = torch.Generator().manual_seed(num_tokens)
    slots = torch.randint(-1, num_active, (num_tokens,), generator=gen).to(torch.int32)
    batch = make_lora_batch(num_tokens, 520, widths, num_slots=num_active, max_rank=16, dtype=torch.bfloat16,
                            device="cuda", token_slots=slots, seed=num_tokens)
    cfg = choose_config(num_tokens, num_active, num_active, 16, 520, len(widths), batch.max_slice_width)
    meta = build_lora_meta(batch.token_slots, num_active, cfg.block_m)
    out = batch.out.clone()
    lora_apply(batch.x, out, batch.lora_a, batch.lora_b, batch.ranks, batch.scaling, batch.slice_loc,
               batch.max_slice_width, meta, cfg, col_align=slice_col_align(loc))
    base = batch.token_slots < 0
    assert torch.equal(out[base], batch.out[base])
    torch.testing.assert_close(out.float(), _reference(batch).float(), **TOL[torch.bfloat16])


@pytest.mark.parametrize("widths", [(4096, 1024, 1024), (14336, 14336)])
@pytest.mark.parametrize("num_tokens, num_active, base_share", [(256, 64, 0.25), (256, 64, 0.0), (64, 8, 0.9),
                                                               (3000, 8, 0.5), (4000, 8, 0.5), (256, 64, 1.0)])
def test_write_only_expand_zeroes_base_rows_bf16(widths, num_tokens, num_active, base_share):
    """The write-first order's expand with ``zero_base`` as LoRAStep launches it (the engine's config for the
    size: programmatic dependent launch, chunk tables, column hint) into an output full of NaN: every element
    written, base rows exactly zero, adapter rows the twin's delta."""
    from loraplex.kernels.lora_expand import slice_col_align
    from loraplex.kernels.lora_ops import lora_expand_apply, lora_shrink_apply
    from loraplex.kernels.lora_ref import lora_expand_ref, lora_shrink_ref
    from loraplex.kernels.lora_shrink import pdl_supported

    loc = [0]
    for w in widths:
        loc.append(loc[-1] + w)
    gen = torch.Generator().manual_seed(num_tokens + int(base_share * 10))
    slots = torch.randint(0, num_active, (num_tokens,), generator=gen)
    slots = torch.where(torch.rand(num_tokens, generator=gen) < base_share, -1, slots).to(torch.int32)
    batch = make_lora_batch(num_tokens, 4096, widths, num_slots=num_active, max_rank=16, dtype=torch.bfloat16,
                            device="cuda", token_slots=slots, seed=3)
    cfg = choose_config(num_tokens, num_active, num_active, 16, 4096, len(widths), batch.max_slice_width,
                        pdl=pdl_supported(batch.x.device))
    meta = build_lora_meta(batch.token_slots, num_active, cfg.block_m)
    chunk_ranks = batch.ranks.index_select(1, meta.chunk_slots.clamp(min=0))
    out = torch.full_like(batch.out, float("nan"))
    y, valid = lora_shrink_apply(batch.x, batch.lora_a, batch.ranks, meta, cfg, None, chunk_ranks)
    lora_expand_apply(y, valid, out, batch.lora_b, batch.ranks, batch.scaling, batch.slice_loc,
                      batch.max_slice_width, meta, cfg, slice_col_align(loc), chunk_ranks, accumulate=False,
                      zero_base=True)
    y_ref = lora_shrink_ref(batch.x.float(), batch.lora_a.float(), batch.token_slots, batch.ranks)
    ref = lora_expand_ref(y_ref, batch.lora_b.float(), batch.token_slots, batch.ranks, batch.scaling,
                          batch.slice_loc, torch.zeros_like(out, dtype=torch.float32), accumulate=False, zero_base=True)
    assert not out.isnan().any(), "every element must be written"
    base = batch.token_slots < 0
    assert torch.equal(out[base], torch.zeros_like(out[base]))
    torch.testing.assert_close(out.float(), ref.to(out.dtype).float(), **TOL[torch.bfloat16])


# ---- metadata in one launch, grids spread over the chunks in use, programmatic dependent launch ----------


@pytest.mark.parametrize("num_tokens, num_slots", [(1, 4), (64, 64), (64, 256), (256, 256), (1000, 1024), (133, 8)])
def test_single_launch_metadata_equals_torch_ops(num_tokens, num_slots):
    from loraplex.kernels.lora_meta import build_lora_meta_torch

    gen = torch.Generator().manual_seed(num_tokens)
    for mix in ("distinct", "identical", "zipf", "uniform"):
        slots = token_slots_for(mix, num_tokens, num_slots, gen).cuda()
        for block_m in (16, 64):
            got = build_lora_meta(slots, num_slots, block_m)
            want = build_lora_meta_torch(slots, num_slots, block_m)
            for field in ("sorted_token_ids", "chunk_slots", "chunk_starts", "chunk_lens", "num_chunks",
                          "chunk_tokens"):
                assert torch.equal(getattr(got, field).long(), getattr(want, field).long()), (mix, block_m, field)


def test_programmatic_dependent_launch_is_on_for_hopper():
    from loraplex.kernels.lora_shrink import pdl_supported

    want = torch.cuda.get_device_capability()[0] >= 9
    assert pdl_supported(torch.device("cuda")) == want
    assert choose_config(64, 64, 64, 16, 4096, 3, 4096, pdl=want).pdl == want


@pytest.mark.parametrize("weight_prefetch", ["off", "first", "l2"])
@pytest.mark.parametrize("proj", ["qkv", "gate_up", "down"])
@pytest.mark.parametrize("mix", ["identical", "eight", "skewed"])
def test_decode_grid_for_distinct_serves_few_adapters_llama3_bf16(proj, mix, weight_prefetch):
    """As the engine's decode CUDA graph: tiles planned for 64 distinct adapters (num_active = 64), run on one
    adapter's 64 tokens, on 8 adapters' 8 tokens each, or a skewed mix: the shrink gives the few chunks more K
    parts, the expand finer column shares; the result is the fp32 twin's."""
    k_dim, widths = LLAMA3_GROUPS[proj]
    gen = torch.Generator().manual_seed(len(proj) + len(mix))
    slots = decode_mix_slots(mix, gen)
    batch = make_lora_batch(64, k_dim, widths, num_slots=64, max_rank=16, dtype=torch.bfloat16, device="cuda",
                            token_slots=slots, seed=3)
    out = _apply(batch, num_active=64, weight_prefetch=weight_prefetch)
    base = batch.token_slots < 0
    assert torch.equal(out[base], batch.out[base])
    torch.testing.assert_close(out.float(), _reference(batch).float(), **TOL[torch.bfloat16])
    if weight_prefetch != "off":  # loading the weights earlier changes no result
        assert torch.equal(out, _apply(batch, num_active=64, weight_prefetch="off"))


def _chain(step, xs0, outs, bases):
    """Layer i adds its delta into outs[i], reading outs[i - 1] as x: each shrink reads what the expand just
    before it wrote (the dependency programmatic dependent launch must keep)."""
    for out, base in zip(outs, bases):
        out.copy_(base)
    x = xs0
    for layer, out in enumerate(outs):
        step.add(layer, "o", x, out)
        x = out


@pytest.mark.parametrize("weight_prefetch", ["default", "off", "first", "l2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chained_launches_with_pdl_under_cuda_graph_replay(dtype, weight_prefetch):
    """A chain of LoRA launches where every shrink reads the previous expand's output, captured in one CUDA graph
    with programmatic dependent launch (as on the H200 by default) and replayed for other adapter mixes than at
    capture: equal to the twin chain, and bit-identical to the same chain launched without PDL and without any
    weight prefetch (the weights loaded before the wait, ``weight_prefetch``, change no result)."""
    from loraplex.adapters.mapping import LoRAStep
    from loraplex.adapters.modules import BaseShapes

    shapes = BaseShapes(num_layers=6, hidden_size=512, q_size=512, kv_size=128, intermediate_size=1024)
    num_tokens, slots_n = 48, 16
    pool, gen = random_slot_pool(shapes, slots_n, 16, "cuda", dtype)
    slots_buf = torch.full((num_tokens,), -1, dtype=torch.int32, device="cuda")
    x0 = torch.randn(num_tokens, 512, generator=gen, device="cuda").to(dtype)
    bases = [torch.randn(num_tokens, 512, generator=gen, device="cuda").to(dtype) for _ in range(6)]
    outs = [torch.empty_like(b) for b in bases]
    cpu_gen = torch.Generator().manual_seed(1)

    def graph_step():
        step = LoRAStep(pool, slots_buf, min(num_tokens, slots_n), use_triton=True)  # as the engine captures
        assert all(c.pdl for c in step._configs.values()) == (torch.cuda.get_device_capability()[0] >= 9)
        if weight_prefetch != "default":
            step._configs = {p: dataclasses.replace(c, weight_prefetch=weight_prefetch)
                             for p, c in step._configs.items()}
        _chain(step, x0, outs, bases)

    graph = capture_cuda_graph(graph_step)
    for mix in ("identical", "distinct", "zipf", "skewed"):
        slots_buf.copy_(token_slots_for(mix, num_tokens, slots_n, cpu_gen).cuda())
        graph.replay()
        torch.cuda.synchronize()
        got = [o.clone() for o in outs]
        # eager, programmatic dependent launch off: the same kernels in plain stream order
        step = LoRAStep(pool, slots_buf, min(num_tokens, slots_n), use_triton=True)
        step._configs = {p: dataclasses.replace(c, pdl=False, weight_prefetch="off") for p, c in step._configs.items()}
        _chain(step, x0, outs, bases)
        torch.cuda.synchronize()
        for a, b in zip(got, outs):
            assert torch.equal(a, b), mix
        # the twin chain in fp32 from the same (rounded) inputs, cast like the kernels after each layer
        twin = LoRAStep(pool, slots_buf, min(num_tokens, slots_n), use_triton=False)
        x = x0
        for layer, base in enumerate(bases):
            a, bt, ranks = pool.layer_view("o", layer)
            ref = lora_apply_ref(x.float(), base.float(), a.float(), bt.float(), twin.token_slots, ranks,
                                 pool.scaling, pool.slice_loc_host["o"]).to(dtype)
            tol = TOL[dtype] if dtype == torch.float32 else dict(rtol=3e-2, atol=5e-2)
            torch.testing.assert_close(got[layer].float(), ref.float(), **tol)
            x = got[layer]  # each layer checked from the kernels' own input
