"""Fused element-wise kernels (interpreter) against their pure-torch twins and against Hugging Face's modules."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # also set by conftest; kept here so this module runs alone

import pytest
import torch

from loraplex.engine.kv_cache import LayerKV
from loraplex.kernels import fused_ops
from loraplex.kernels.fused_ops import (
    add_rms_norm_ref,
    rms_norm_ref,
    rope_ref,
    rope_store_kv_ref,
    silu_mul_ref,
)


def _tol(dtype):
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-3, "rtol": 2e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hidden", [64, 100])  # 100: not a power of two (masked tail)
def test_rms_norm_and_add_norm_match_twins(dtype, hidden):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(7, hidden, generator=gen).to(dtype)
    res = torch.randn(7, hidden, generator=gen).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    x_before, res_before = x.clone(), res.clone()

    torch.testing.assert_close(fused_ops.rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), **_tol(dtype))
    normed, summed = fused_ops.add_rms_norm(x, res, w, 1e-5)
    want_normed, want_summed = add_rms_norm_ref(x, res, w, 1e-5)
    assert torch.equal(summed, want_summed)  # the residual add rounds exactly as torch's
    torch.testing.assert_close(normed, want_normed, **_tol(dtype))
    assert torch.equal(x, x_before) and torch.equal(res, res_before)  # inputs untouched


def test_rms_norm_twin_is_hugging_face_rmsnorm():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    gen = torch.Generator().manual_seed(2)
    hf = LlamaRMSNorm(48, eps=1e-5)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(48, generator=gen))
    x = torch.randn(5, 48, generator=gen)
    torch.testing.assert_close(fused_ops.rms_norm(x, hf.weight.detach(), 1e-5), hf(x).detach(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (3, 3), (4, 1)])  # GQA, MHA, MQA
def test_rope_store_kv_matches_twin(dtype, heads, kv_heads):
    gen = torch.Generator().manual_seed(3)
    t, d, num_blocks, block_size = 9, 16, 5, 4
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=gen).to(dtype)
    positions = torch.randint(0, 500, (t,), generator=gen)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = positions.float()[:, None] * inv_freq[None]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:t]
    slots[[1, 6]] = -1  # padding rows: nothing stored
    shape = (num_blocks, block_size, kv_heads, d)
    kc, vc = torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype)
    want_kc, want_vc = kc.clone(), vc.clone()
    want_q = rope_store_kv_ref(qkv, cos, sin, want_kc, want_vc, slots, heads, kv_heads, d)

    q = fused_ops.rope_store_kv(qkv, cos, sin, kc, vc, slots, heads, kv_heads, d)

    torch.testing.assert_close(q, want_q, **_tol(dtype))
    torch.testing.assert_close(kc, want_kc, **_tol(dtype))
    assert torch.equal(vc, want_vc)  # v is copied, not computed
    s = int(slots[0])
    k0 = rope_ref(qkv[:1, heads * d:(heads + kv_heads) * d].view(1, kv_heads, d), cos[:1], sin[:1])[0]
    torch.testing.assert_close(kc[s // block_size, s % block_size], k0, **_tol(dtype))


def test_rope_twin_is_hugging_face_rotary():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(4)
    t, h, d = 6, 2, 8
    q, k = torch.randn(1, h, t, d, generator=gen), torch.randn(1, h, t, d, generator=gen)
    cos, sin = torch.randn(1, t, d, generator=gen), torch.randn(1, t, d, generator=gen)
    want_q, _ = apply_rotary_pos_emb(q, k, cos, sin)
    got = rope_ref(q[0].transpose(0, 1), cos[0], sin[0]).transpose(0, 1)
    torch.testing.assert_close(got, want_q[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("inter", [40, 4100])  # 4100: more than one column block per row
def test_silu_mul_matches_twin(dtype, inter):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 2 * inter, generator=gen).to(dtype)
    torch.testing.assert_close(fused_ops.silu_mul(x), silu_mul_ref(x), **_tol(dtype))


def test_empty_batches():
    x = torch.empty(0, 32)
    w = torch.ones(32)
    assert fused_ops.rms_norm(x, w, 1e-6).shape == (0, 32)
    assert fused_ops.silu_mul(torch.empty(0, 64)).shape == (0, 32)


def test_model_forward_with_fused_kernels_equals_twins():
    """The whole Llama forward (GQA, 2 layers, a prefill then a decode over the paged cache) with the Triton
    kernels under the interpreter equals the twin path."""
    from loraplex.engine.attention import AttentionMetadata, get_attention_backend
    from loraplex.engine.models.llama import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=40, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
                      max_position_embeddings=64, tie_word_embeddings=False, qkv_bias=False, o_bias=False,
                      mlp_bias=False, sliding_window=None)
    torch.manual_seed(6)
    models = [LlamaForCausalLM(cfg, "cpu", torch.float32, fused_ops=f) for f in (False, True)]
    for p in models[0].parameters():
        p.data.normal_(0, 0.2)
    models[1].load_state_dict(models[0].state_dict())
    backend = get_attention_backend("cpu")
    block_size, num_blocks = 4, 6
    outs = []
    for model in models:
        caches = [LayerKV(torch.zeros(num_blocks, block_size, 2, 8), torch.zeros(num_blocks, block_size, 2, 8))
                  for _ in range(cfg.num_layers)]
        table = torch.tensor([[3, 1, 4]], dtype=torch.int32)
        prompt = torch.tensor([5, 9, 2, 7, 7, 1])
        slots = torch.tensor([table[0, i // block_size] * block_size + i % block_size for i in range(6)])
        meta = AttentionMetadata(backend, slots, table, torch.tensor([0, 6], dtype=torch.int32),
                                 torch.tensor([6], dtype=torch.int32), 6, 6)
        h1 = model(prompt, torch.arange(6), caches, meta)
        meta = AttentionMetadata(backend, torch.tensor([table[0, 1] * block_size + 2]), table,
                                 torch.tensor([0, 1], dtype=torch.int32), torch.tensor([7], dtype=torch.int32), 1, 7)
        h2 = model(torch.tensor([11]), torch.tensor([6]), caches, meta)
        outs.append((h1, h2, caches))
    (a1, a2, ca), (b1, b2, cb) = outs
    torch.testing.assert_close(b1, a1, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(b2, a2, atol=1e-5, rtol=1e-5)
    for (ka, va, *_), (kb, vb, *_) in zip(ca, cb):
        torch.testing.assert_close(kb, ka, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(vb, va, atol=1e-5, rtol=1e-5)
    assert a2.abs().sum() > 0
