"""The base GEMM with the LoRA expand in its epilogue (``lora_gemm``, interpreter, fp32/fp16) against its twin and
against the usual path (base projection, then shrink and expand): mixed adapters and ranks, base rows, a slice an
adapter skips, split-K partials of the shrink, a K that is not a multiple of the K tile, bias."""

from __future__ import annotations

import importlib
import os

os.environ["TRITON_INTERPRET"] = "1"  # also set by conftest; kept here so this module runs alone

import pytest
import torch
import torch.nn.functional as F
from triton.runtime.interpreter import InterpretedFunction

from loraplex.kernels import lora_gemm, lora_shrink
from loraplex.kernels.lora_meta import build_lora_meta
from loraplex.kernels.lora_ref import lora_apply_ref, lora_shrink_ref
from loraplex.kernels.lora_testing import make_lora_batch

if not isinstance(lora_gemm._gemm_lora_kernel, InterpretedFunction):
    for module in (lora_shrink, lora_gemm):
        importlib.reload(module)

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=1e-2, atol=2e-2)}
WIDTHS = (32, 16, 16)  # a GQA-like q | k | v: unequal slices, each a multiple of the column tile
K_DIM = 48  # not a multiple of the K tile below
BLOCKS = (16, 16, 32, 4, 1)  # BLOCK_M, BLOCK_N, BLOCK_K, warps, stages: large tiles, tiny shapes (interpreter cost)


def _run(batch, slots, split_k, bias=None, block_k=16):
    meta = build_lora_meta(slots, batch.lora_a.shape[0], 16)
    y = lora_shrink.lora_shrink(batch.x, batch.lora_a, batch.ranks, meta, split_k=split_k, block_r=16,
                                block_k=block_k)
    split = lora_shrink.shrink_split(K_DIM, meta, split_k, block_k)
    weight = batch.out.new_empty(sum(WIDTHS), K_DIM).normal_(0.0, 0.2, generator=torch.Generator().manual_seed(3))
    out = lora_gemm.gemm_lora(batch.x, weight, bias, y, batch.lora_b, slots, batch.ranks, batch.scaling,
                              batch.slice_loc, lora_shrink.num_chunks_of(meta), split_k=split_k,
                              shrink_progs=split["shrink_progs"], k_tiles=split["k_tiles"], slice_widths=WIDTHS,
                              blocks=BLOCKS)
    return out, weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_tokens, mix, split_k", [(1, "identical", 1), (7, "distinct", 2), (45, "zipf", 3),
                                                      (33, "uniform", 1)])
def test_fused_gemm_equals_twin_and_the_usual_path(num_tokens, mix, split_k, dtype):
    batch = make_lora_batch(num_tokens, K_DIM, WIDTHS, num_slots=5, max_rank=16, mix=mix, dtype=dtype,
                            seed=num_tokens)
    slots = batch.token_slots.clone()
    if num_tokens > 1:
        slots[::4] = -1  # base rows among the adapters'
    out, weight = _run(batch, slots, split_k)
    y_ref = lora_shrink_ref(batch.x, batch.lora_a, slots, batch.ranks)
    loc = batch.slice_loc.tolist()
    want = lora_gemm.lora_gemm_ref(batch.x, weight, None, y_ref, batch.lora_b, slots, batch.ranks, batch.scaling, loc)
    torch.testing.assert_close(out, want, **TOL[dtype])
    usual = lora_apply_ref(batch.x, F.linear(batch.x, weight), batch.lora_a, batch.lora_b, slots, batch.ranks,
                           batch.scaling, loc)
    torch.testing.assert_close(out, usual, **TOL[dtype])
    base = slots < 0
    torch.testing.assert_close(out[base], F.linear(batch.x[base], weight), **TOL[dtype])
    if (~base).any():
        assert not torch.allclose(out[~base], F.linear(batch.x[~base], weight), atol=1e-3)  # the delta counts


def test_bias_and_a_skipped_slice():
    batch = make_lora_batch(9, K_DIM, WIDTHS, num_slots=4, max_rank=8, mix="distinct", seed=7)
    batch.ranks[1, :] = 0  # no adapter targets k
    bias = torch.randn(sum(WIDTHS), generator=torch.Generator().manual_seed(1))
    out, weight = _run(batch, batch.token_slots, 2, bias=bias)
    y_ref = lora_shrink_ref(batch.x, batch.lora_a, batch.token_slots, batch.ranks)
    loc = batch.slice_loc.tolist()
    want = lora_gemm.lora_gemm_ref(batch.x, weight, bias, y_ref, batch.lora_b, batch.token_slots, batch.ranks,
                                   batch.scaling, loc)
    torch.testing.assert_close(out, want, **TOL[torch.float32])
    k_cols = slice(loc[1], loc[2])
    torch.testing.assert_close(out[:, k_cols], F.linear(batch.x, weight, bias)[:, k_cols], **TOL[torch.float32])


def test_base_projection_alone():
    x = torch.randn(5, K_DIM, generator=torch.Generator().manual_seed(0))
    weight = torch.randn(64, K_DIM, generator=torch.Generator().manual_seed(1))
    out = lora_gemm.gemm_lora(x, weight, None, None, blocks=BLOCKS)
    torch.testing.assert_close(out, F.linear(x, weight), **TOL[torch.float32])


def test_blocks_fit_every_slice():
    # Llama-3-8B decode shapes: a column tile divides N and every slice; about two programs per SM or the narrowest
    for n, k, widths in ((6144, 4096, (4096, 1024, 1024)), (4096, 4096, (4096,)), (28672, 4096, (14336, 14336)),
                         (4096, 14336, (4096,))):
        bm, bn, bk, warps, stages = lora_gemm.choose_gemm_blocks(64, n, k, widths)
        assert bm == 64 and bn in (16, 32, 64, 128) and all(w % bn == 0 for w in widths) and bk % 16 == 0
    assert lora_gemm.choose_gemm_blocks(5, 6144, 4096, (4096, 1024, 1024))[0] == 16
    assert lora_gemm.choose_gemm_blocks(64, 100, 64, (100,))[1] == 0  # nothing fits: the caller keeps the usual path
    assert not lora_gemm.gemm_lora_supported(100, (100,))
