"""A float8 e4m3 KV cache on CUDA (``kv_cache_dtype="fp8"``): the compiled store and attention kernels against
the twins with bf16 queries, and the engine (CUDA graphs, piecewise graphs, prefix cache, forks) against the CPU
engine over the same fp8 cache."""

from __future__ import annotations

import random

import pytest
import torch

from loraplex import LLM, SamplingParams
from loraplex.kernels.attention_ref import paged_attention_ref, store_kv_ref, to_cache_dtype
from loraplex.kernels.attn_testing import make_paged_batch
from loraplex.kernels.fused_ops import rope_store_kv
from loraplex.kernels.fused_ops_ref import rope_store_kv_ref
from loraplex.kernels.kv_store import store_kv
from loraplex.kernels.paged_attention import paged_attention, paged_attention_decode

DEV, FP8 = "cuda", torch.float8_e4m3fn
KV_HEADS, HEAD_DIM, BLOCK = 8, 128, 16
TOL = dict(rtol=2e-2, atol=1e-2)


@pytest.fixture(scope="module", autouse=True)
def compiled_triton():
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(tl.cdiv, InterpretedFunction):
        pytest.skip("triton was imported with TRITON_INTERPRET=1: run tests/gpu in its own pytest process")


def _batch(seq_lens, query_lens, group, seed):
    pb = make_paged_batch(seq_lens, query_lens, KV_HEADS * group, KV_HEADS, HEAD_DIM, BLOCK, dtype=torch.bfloat16,
                          device=DEV, seed=seed, kv_dtype=FP8)
    pb.query = (pb.query.float() * 3.0).to(torch.bfloat16)  # peaked attention: O(1) outputs
    return pb


def _ref(pb):
    return paged_attention_ref(pb.query, pb.key_cache, pb.value_cache, pb.block_tables, pb.query_start_loc,
                               pb.seq_lens, pb.scale)


@pytest.mark.parametrize("f16_dots", [None, False, True])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("num_splits", [None, 1, 5])
def test_decode_over_fp8_cache(group, num_splits, f16_dots):
    seq_lens = [1, 17, 1023, 4099, 20_001]
    pb = _batch(seq_lens, [1] * len(seq_lens), group, seed=group)
    out = paged_attention_decode(pb.query, pb.key_cache, pb.value_cache, pb.block_tables, pb.seq_lens, pb.scale,
                                 num_splits=num_splits, f16_dots=f16_dots)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), _ref(pb).float(), **TOL)


@pytest.mark.parametrize("group", [1, 4])
def test_prefill_chunk_and_mixed_over_fp8_cache(group):
    seq_lens, query_lens = [300, 1, 5000, 777, 64], [1, 1, 1, 777, 40]
    pb = _batch(seq_lens, query_lens, group, seed=10 + group)
    want = _ref(pb).float()
    for kw in ({}, {"num_decodes": 3, "max_seq_len": 5000}):
        out = paged_attention(pb.query, pb.key_cache, pb.value_cache, pb.block_tables, pb.query_start_loc,
                              pb.seq_lens, pb.scale, **kw)
        torch.testing.assert_close(out.float(), want, **TOL)


def test_stores_into_fp8_equal_the_twins_bit_for_bit():
    gen = torch.Generator().manual_seed(3)
    t, heads, num_blocks = 37, 32, 64
    key = (torch.randn(t, KV_HEADS, HEAD_DIM, generator=gen) * 40).to(torch.bfloat16)
    key[0, 0, :3] = torch.tensor([600.0, -9000.0, 448.0])  # past e4m3's range: saturates (token 0 is stored)
    key = key.to(DEV)
    value = torch.randn(t, KV_HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16).to(DEV)
    slots = torch.randperm(num_blocks * BLOCK, generator=gen)[:t].to(DEV)
    slots[5] = -1
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    kc, vc = torch.zeros(shape, dtype=FP8, device=DEV), torch.zeros(shape, dtype=FP8, device=DEV)
    want_k, want_v = kc.clone(), vc.clone()
    store_kv_ref(key, value, want_k, want_v, slots)
    store_kv(key, value, kc, vc, slots)
    for got, want, x in ((kc, want_k, key), (vc, want_v, value)):
        diff = got.view(torch.uint8) != want.view(torch.uint8)
        if diff.any():  # name the values that differ: their inputs, the kernel's and the twin's bytes
            flat = torch.full(got.shape[:2], -1, dtype=torch.long, device=DEV).view(-1)
            flat[slots[slots >= 0]] = torch.arange(t, device=DEV)[slots >= 0]
            rows = flat.view(got.shape[:2])[diff.any(-1).any(-1)]
            src = x[rows[rows >= 0]][diff[diff.any(-1).any(-1)][rows >= 0]]
            raise AssertionError(f"{int(diff.sum())} bytes differ; inputs {src[:8].float().tolist()}, kernel "
                                 f"{got.view(torch.uint8)[diff][:8].tolist()}, twin {want.view(torch.uint8)[diff][:8].tolist()}")
    assert kc.float().abs().max() == 448.0

    qkv = torch.randn(t, (heads + 2 * KV_HEADS) * HEAD_DIM, generator=gen).to(torch.bfloat16).to(DEV)
    angles = (torch.rand(t, HEAD_DIM // 2, generator=gen) * 6).to(DEV)
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)
    kc.zero_(), vc.zero_(), want_k.zero_(), want_v.zero_()
    q = rope_store_kv(qkv, cos, sin, kc, vc, slots, heads, KV_HEADS, HEAD_DIM)
    want_q = rope_store_kv_ref(qkv, cos, sin, want_k, want_v, slots, heads, KV_HEADS, HEAD_DIM)
    torch.testing.assert_close(q.float(), want_q.float(), **TOL)
    assert torch.equal(vc.view(torch.uint8), want_v.view(torch.uint8))
    # RoPE computed twice (kernel and twin round differently before the cast): a key may land one e4m3 step away
    # (2^-3 relative), or, where x cos - y sin cancels, a 16-bit rounding of terms of size ~1 away (1e-2 absolute),
    # and only a few do
    torch.testing.assert_close(kc.float(), want_k.float(), rtol=0.125, atol=1e-2)
    assert (kc.view(torch.uint8) == want_k.view(torch.uint8)).float().mean() > 0.999


def test_round_to_e4m3_compiled_gives_the_bits_of_torchs_cast():
    """The kernels' rounding helper compiled for this GPU: every e4m3 value, the midpoints, subnormals, values that
    round to zero of either sign (-0 included), values past the range: torch's saturating cast, bit for bit."""
    from tests.unit.kernels.fp8_probe import round_kernel

    values = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    values = values[torch.isfinite(values)].unique()
    mids = (values[1:] + values[:-1]) / 2
    x = torch.cat([values, mids, mids * (1 + 1e-6), mids * (1 - 1e-6), torch.randn(20000),
                   torch.tensor([0.0, -0.0, 1e-12, -1e-12, -2.0 ** -11, 449.0, 465.0, -1e6])]).to(DEV)
    out = torch.empty(x.shape, dtype=FP8, device=DEV)
    round_kernel[(-(-x.numel() // 4096),)](x, out, x.numel(), BLOCK=4096)
    want = to_cache_dtype(x, FP8)
    same = out.view(torch.uint8) == want.view(torch.uint8)
    assert same.all(), (x[~same][:8].tolist(), out.view(torch.uint8)[~same][:8].tolist(),
                        want.view(torch.uint8)[~same][:8].tolist())


def test_to_cache_dtype_on_cuda_equals_the_cpu_cast():
    x = torch.randn(100_000) * 100
    assert torch.equal(to_cache_dtype(x.to(DEV), FP8).cpu().view(torch.uint8),
                       to_cache_dtype(x, FP8).view(torch.uint8))


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(8, 512) for _ in range(n)] for n in (1, 5, 16, 17, 40, 77, 130, 300)]


def test_cuda_fp8_engine_gives_the_cpu_fp8_engines_greedy_tokens(tiny_model):
    """float32 compute over the same fp8 cache: the Triton kernels (graphs on) against the CPU twins."""
    prompts = [{"prompt_token_ids": p} for p in _prompts(4)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    cuda = LLM(tiny_model["model_dir"], device="cuda", dtype="float32", kv_cache_dtype="fp8",
               max_num_batched_tokens=64)
    cpu = LLM(tiny_model["model_dir"], device="cpu", dtype="float32", kv_cache_dtype="fp8",
              max_num_batched_tokens=64)
    assert cuda.engine.runner.kv_caches[0][0].dtype == FP8
    for a, b in zip(cuda.generate(prompts, params), cpu.generate(prompts, params)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_bf16_fp8_engine_graphs_equal_eager_at_one_byte_per_value(tiny_model):
    prompts = [{"prompt_token_ids": p} for p in _prompts(5)]
    params = SamplingParams(n=2, max_tokens=20, temperature=0.8, seed=3, ignore_eos=True, logprobs=1)
    kw = dict(device="cuda", dtype="bfloat16", kv_cache_dtype="fp8", max_model_len=512)
    graphs = LLM(tiny_model["model_dir"], **kw)
    eager = LLM(tiny_model["model_dir"], enforce_eager=True, **kw)
    for x, y in zip(graphs.generate(prompts, params), eager.generate(prompts, params)):
        for cx, cy in zip(x.outputs, y.outputs):
            assert len(cx.token_ids) == 20 and cx.token_ids[:1] == cy.token_ids[:1]
            assert all(v.logprob == v.logprob for entry in cx.logprobs for v in entry.values())  # no NaN
    runner = graphs.engine.runner
    mc = runner.model_config
    assert runner.bytes_per_block() == 2 * mc.num_layers * runner.config.block_size * mc.num_kv_heads * mc.head_dim


# ---- INT8 with a scale per (token, KV head) row (kv_cache_dtype="int8") ----
I8 = torch.int8


def _batch_int8(seq_lens, query_lens, group, seed):
    pb = make_paged_batch(seq_lens, query_lens, KV_HEADS * group, KV_HEADS, HEAD_DIM, BLOCK, dtype=torch.bfloat16,
                          device=DEV, seed=seed, kv_dtype=I8)
    pb.query = (pb.query.float() * 3.0).to(torch.bfloat16)
    return pb


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("num_splits", [None, 1, 5])
def test_decode_over_int8_cache(group, num_splits):
    seq_lens = [1, 17, 1023, 4099, 20_001]
    pb = _batch_int8(seq_lens, [1] * len(seq_lens), group, seed=group)
    out = paged_attention_decode(pb.query, pb.key_cache, pb.value_cache, pb.block_tables, pb.seq_lens, pb.scale,
                                 num_splits=num_splits, **pb.scales)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), _ref_scaled(pb).float(), **TOL)


def _ref_scaled(pb):
    return paged_attention_ref(pb.query, pb.key_cache, pb.value_cache, pb.block_tables, pb.query_start_loc,
                               pb.seq_lens, pb.scale, **pb.scales)


@pytest.mark.parametrize("group", [1, 4])
def test_prefill_chunk_and_mixed_over_int8_cache(group):
    pb = _batch_int8([300, 1, 5000, 777, 64], [1, 1, 1, 777, 40], group, seed=20 + group)
    want = _ref_scaled(pb).float()
    for kw in ({}, {"num_decodes": 3, "max_seq_len": 5000}):
        out = paged_attention(pb.query, pb.key_cache, pb.value_cache, pb.block_tables, pb.query_start_loc,
                              pb.seq_lens, pb.scale, **kw, **pb.scales)
        torch.testing.assert_close(out.float(), want, **TOL)


def test_store_into_int8_is_within_one_step_of_the_twin():
    """The GPU's fp32 reciprocal and fused multiply-add may round a value at a tie the other way: +-1 at most."""
    gen = torch.Generator().manual_seed(4)
    t, num_blocks = 37, 64
    key = (torch.randn(t, KV_HEADS, HEAD_DIM, generator=gen) * 40).to(torch.bfloat16).to(DEV)
    value = torch.randn(t, KV_HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16).to(DEV)
    slots = torch.randperm(num_blocks * BLOCK, generator=gen)[:t].to(DEV)
    slots[5] = -1
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    got = [torch.zeros(shape, dtype=I8, device=DEV) for _ in range(2)] + [
        torch.zeros(shape[:3], device=DEV) for _ in range(2)]
    want = [x.clone() for x in got]
    store_kv_ref(key, value, want[0], want[1], slots, want[2], want[3])
    store_kv(key, value, got[0], got[1], slots, key_scale=got[2], value_scale=got[3])
    for g, w in zip(got[:2], want[:2]):
        assert (g.int() - w.int()).abs().max() <= 1 and (g != w).float().mean() < 1e-3
    for g, w in zip(got[2:], want[2:]):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=0)


def test_cuda_int8_engine_tracks_the_cpu_int8_engine(tiny_model):
    """float32 compute over int8 caches on both (their stores may differ by one step at rare ties): the same
    greedy tokens, or the first difference late and at a near tie."""
    prompts = [{"prompt_token_ids": p} for p in _prompts(6)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=2)
    kw = dict(dtype="float32", kv_cache_dtype="int8", max_num_batched_tokens=64)
    cuda = LLM(tiny_model["model_dir"], device="cuda", **kw).generate(prompts, params)
    cpu = LLM(tiny_model["model_dir"], device="cpu", **kw).generate(prompts, params)
    same = 0
    for a, b in zip(cuda, cpu):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        same += ta == tb
        if ta != tb:
            i = next(i for i, (x, y) in enumerate(zip(ta, tb)) if x != y)
            top = sorted(b.outputs[0].logprobs[i].values(), key=lambda v: -v.logprob)
            assert top[0].logprob - top[1].logprob < 0.05, (i, top)  # a near tie, not a wrong cache
    assert same >= len(prompts) - 1
