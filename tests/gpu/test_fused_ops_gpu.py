"""Fused element-wise kernels on CUDA in bf16 at Llama-3-8B sizes: against their twins, inside a CUDA graph,
and the whole model forward fused vs twins."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# one bf16 ulp at |x| ~ 4 is 0.03; the norm's float32 sum order differs from torch's
BF16 = {"atol": 3e-2, "rtol": 1.6e-2}


def _rope_tables(positions, d, dtype):
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, d, 2, device=positions.device).float() / d))
    freqs = positions.float()[:, None] * inv_freq[None]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("tokens", [1, 64, 1031])
def test_norms_and_silu_bf16(tokens):
    from loraplex.kernels import fused_ops as k

    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, 4096, device="cuda", generator=gen).bfloat16()
    res = torch.randn(tokens, 4096, device="cuda", generator=gen).bfloat16()
    w = (1 + 0.1 * torch.randn(4096, device="cuda", generator=gen)).bfloat16()
    torch.testing.assert_close(k.rms_norm(x, w, 1e-5), k.rms_norm_ref(x, w, 1e-5), **BF16)
    normed, summed = k.add_rms_norm(x, res, w, 1e-5)
    want_normed, want_summed = k.add_rms_norm_ref(x, res, w, 1e-5)
    assert torch.equal(summed, want_summed)
    torch.testing.assert_close(normed, want_normed, **BF16)
    gu = torch.randn(tokens, 2 * 14336, device="cuda", generator=gen).bfloat16()
    torch.testing.assert_close(k.silu_mul(gu), k.silu_mul_ref(gu), **BF16)


@pytest.mark.parametrize("tokens", [1, 64, 517])
def test_rope_store_kv_bf16(tokens):
    from loraplex.kernels import fused_ops as k

    gen = torch.Generator(device="cuda").manual_seed(tokens)
    hq, hkv, d, num_blocks, bs = 32, 8, 128, 300, 16
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, device="cuda", generator=gen).bfloat16()
    cos, sin = _rope_tables(torch.randint(0, 30000, (tokens,), device="cuda", generator=gen), d, torch.bfloat16)
    slots = torch.randperm(num_blocks * bs, device="cuda", generator=gen)[:tokens]
    slots[::7] = -1
    kc = torch.randn(num_blocks, bs, hkv, d, device="cuda", generator=gen).bfloat16()
    vc = torch.randn_like(kc)
    want_kc, want_vc = kc.clone(), vc.clone()
    want_q = k.rope_store_kv_ref(qkv, cos, sin, want_kc, want_vc, slots, hq, hkv, d)
    q = k.rope_store_kv(qkv, cos, sin, kc, vc, slots, hq, hkv, d)
    torch.testing.assert_close(q, want_q, **BF16)
    torch.testing.assert_close(kc, want_kc, **BF16)
    assert torch.equal(vc, want_vc)


def test_fused_kernels_replay_in_cuda_graph():
    from loraplex.kernels import fused_ops as k

    x = torch.randn(64, 4096, device="cuda").bfloat16()
    res = torch.randn_like(x)
    w = torch.randn(4096, device="cuda").bfloat16()
    for _ in range(2):  # compile outside the capture
        k.add_rms_norm(x, res, w, 1e-5)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        normed, summed = k.add_rms_norm(x, res, w, 1e-5)
    x.copy_(torch.randn_like(x))  # new inputs after capture
    graph.replay()
    torch.cuda.synchronize()
    want_normed, want_summed = k.add_rms_norm_ref(x, res, w, 1e-5)
    assert torch.equal(summed, want_summed)
    torch.testing.assert_close(normed, want_normed, **BF16)


def test_model_forward_fused_vs_twins_bf16():
    from loraplex.engine.attention import AttentionMetadata, get_attention_backend
    from loraplex.engine.kv_cache import LayerKV
    from loraplex.engine.models.llama import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=1000, hidden_size=512, intermediate_size=1536, num_layers=4, num_heads=8,
                      num_kv_heads=2, head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=None,
                      max_position_embeddings=4096, tie_word_embeddings=False, qkv_bias=False, o_bias=False,
                      mlp_bias=False, sliding_window=None)
    torch.manual_seed(0)
    models = [LlamaForCausalLM(cfg, "cuda", torch.bfloat16, fused_ops=f) for f in (False, True)]
    for p in models[0].parameters():
        p.data.normal_(0, 0.05)
    models[1].load_state_dict(models[0].state_dict())
    backend = get_attention_backend("cuda")
    n, bs = 300, 16
    table = torch.arange(1, 1 + -(-n // bs), device="cuda", dtype=torch.int32)[None]
    ids = torch.randint(0, 1000, (n,), device="cuda")
    slots = (table[0, torch.arange(n, device="cuda") // bs] * bs + torch.arange(n, device="cuda") % bs).long()
    hidden = []
    for model in models:
        caches = [LayerKV(torch.zeros(40, bs, 2, 64, device="cuda", dtype=torch.bfloat16),
                          torch.zeros(40, bs, 2, 64, device="cuda", dtype=torch.bfloat16)) for _ in range(4)]
        meta = AttentionMetadata(backend, slots, table, torch.tensor([0, n], device="cuda", dtype=torch.int32),
                                 torch.tensor([n], device="cuda", dtype=torch.int32), n, n)
        hidden.append(model(ids, torch.arange(n, device="cuda"), caches, meta).float())
    ref, got = hidden
    assert (got - ref).abs().max() < 0.1 * ref.abs().max()
    cos = torch.nn.functional.cosine_similarity(got, ref, dim=-1)
    assert cos.min() > 0.999, f"fused forward drifted from the twin path: min cosine {cos.min():.5f}"
