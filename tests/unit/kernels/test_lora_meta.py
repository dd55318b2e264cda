"""Device-built LoRA metadata: tokens grouped by slot, chunks of fixed maximum count."""

from __future__ import annotations

import importlib
import os

os.environ["TRITON_INTERPRET"] = "1"  # also set by conftest; kept here so this module runs alone

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

from loraplex.kernels import lora_meta
from loraplex.kernels.lora_meta import build_lora_meta, build_lora_meta_torch, max_chunks_for

if not isinstance(lora_meta._lora_meta_kernel, InterpretedFunction):
    importlib.reload(lora_meta)
    from loraplex.kernels.lora_meta import build_lora_meta, build_lora_meta_torch  # noqa: F811


def test_chunks_cover_each_slot_run_in_order():
    slots = torch.tensor([2, -1, 0, 2, 2, 0, -1, 2, 2, 5], dtype=torch.int32)
    meta = build_lora_meta(slots, num_slots=8, block_m=2)
    assert meta.max_chunks == max_chunks_for(10, 8, 2) == 5 + 8
    assert meta.sorted_token_ids.tolist()[:8] == [2, 5, 0, 3, 4, 7, 8, 9]  # stable within a slot
    assert set(meta.sorted_token_ids.tolist()[8:]) == {1, 6}
    used = meta.chunk_slots >= 0
    assert meta.chunk_slots[used].tolist() == [0, 2, 2, 2, 5]
    assert meta.chunk_starts[used].tolist() == [0, 2, 4, 6, 7]
    assert meta.chunk_lens[used].tolist() == [2, 2, 2, 1, 1]
    assert (meta.chunk_lens[~used] == 0).all()
    # every adapter token is in exactly one chunk; base tokens in none
    covered = torch.cat([meta.sorted_token_ids[s:s + n] for s, n in
                         zip(meta.chunk_starts[used].tolist(), meta.chunk_lens[used].tolist())])
    assert sorted(covered.tolist()) == [0, 2, 3, 4, 5, 7, 8, 9]
    for c in range(int(used.sum())):
        s, n, slot = int(meta.chunk_starts[c]), int(meta.chunk_lens[c]), int(meta.chunk_slots[c])
        assert (slots[meta.sorted_token_ids[s:s + n].long()] == slot).all()
        # the token table row: the same tokens, then -1
        assert meta.chunk_tokens[c].tolist() == meta.sorted_token_ids[s:s + n].tolist() + [-1] * (2 - n)
    assert (meta.chunk_tokens[~used] == -1).all()


def test_all_base_and_empty_batches():
    meta = build_lora_meta(torch.full((5,), -1, dtype=torch.int32), num_slots=4, block_m=16)
    assert (meta.chunk_slots == -1).all() and meta.max_chunks == 1 + 4
    empty = build_lora_meta(torch.zeros(0, dtype=torch.int32), num_slots=4, block_m=16)
    assert empty.max_chunks == 0


def test_num_chunks_counts_the_chunks_in_use():
    slots = torch.tensor([2, -1, 0, 2, 2, 0, -1, 2, 2, 5], dtype=torch.int32)
    meta = build_lora_meta(slots, num_slots=8, block_m=2)
    assert int(meta.num_chunks) == int((meta.chunk_slots >= 0).sum()) == 5
    assert (meta.chunk_slots[:5] >= 0).all() and (meta.chunk_slots[5:] == -1).all()  # in-use chunks first
    assert int(build_lora_meta(torch.full((5,), -1, dtype=torch.int32), 4, 16).num_chunks) == 0


@pytest.mark.parametrize("num_tokens, num_slots, block_m", [(1, 4, 16), (7, 8, 16), (64, 64, 16), (133, 8, 64),
                                                            (300, 40, 16), (5, 1, 2)])
def test_single_launch_builder_equals_torch_builder(num_tokens, num_slots, block_m):
    """The one-program Triton builder (used on CUDA for decode steps) gives exactly the torch ops' metadata:
    random mixes, one adapter, and all-base batches."""
    gen = torch.Generator().manual_seed(num_tokens * 7 + num_slots)
    cases = [torch.randint(-1, num_slots, (num_tokens,), generator=gen, dtype=torch.int32),
             torch.full((num_tokens,), num_slots // 2, dtype=torch.int32),
             torch.full((num_tokens,), -1, dtype=torch.int32)]
    for slots in cases:
        got = build_lora_meta(slots, num_slots, block_m, use_kernel=True)
        want = build_lora_meta_torch(slots, num_slots, block_m)
        for field in ("sorted_token_ids", "chunk_slots", "chunk_starts", "chunk_lens", "num_chunks", "chunk_tokens"):
            assert torch.equal(getattr(got, field).long(), getattr(want, field).long()), field
        assert got.max_chunks == max_chunks_for(num_tokens, num_slots, block_m)


def test_random_slot_pool_fills_every_slot_within_its_ranks():
    from loraplex.adapters.modules import BaseShapes
    from loraplex.kernels.lora_testing import random_slot_pool

    shapes = BaseShapes(num_layers=2, hidden_size=64, q_size=64, kv_size=16, intermediate_size=128)
    pool, gen = random_slot_pool(shapes, 4, 8, "cpu", torch.float32)
    assert all(t.abs().sum() > 0 for t in (*pool.a.values(), *pool.bt.values()))
    assert int(pool.ranks.min()) >= 1 and int(pool.ranks.max()) <= 8
    assert float(pool.scaling.min()) >= 0.5 and float(pool.scaling.max()) < 1.5
    assert isinstance(gen, torch.Generator)


@pytest.mark.parametrize("use_kernel", [False, True])
def test_max_adapters_bounds_the_chunk_tables(use_kernel):
    """A plan for at most N adapters: tables of ``cdiv(T, block_m) + N`` chunks, the same chunks in use as the
    pool-sized tables when the step keeps the bound, and a step that breaks it is clamped to the tables (kernels
    never read past them)."""
    slots = torch.tensor([3, 3, -1, 7, 3, 7, 7, 3, 3, -1, 7, 3], dtype=torch.int32)  # 2 adapters
    full = build_lora_meta(slots, num_slots=16, block_m=4, use_kernel=use_kernel)
    small = build_lora_meta(slots, num_slots=16, block_m=4, use_kernel=use_kernel, max_adapters=2)
    assert full.max_chunks == 3 + 12 and small.max_chunks == max_chunks_for(12, 16, 4, max_adapters=2) == 3 + 2
    used = int(full.num_chunks)
    assert int(small.num_chunks) == used == 3  # slot 3: 6 tokens (2 chunks of 4), slot 7: 4 (1 chunk)
    for field in ("chunk_slots", "chunk_starts", "chunk_lens", "chunk_tokens"):
        assert torch.equal(getattr(small, field)[:used], getattr(full, field)[:used]), field
    assert torch.equal(small.sorted_token_ids, full.sorted_token_ids)
    broken = torch.tensor([0, 1, 2, 3, 4, 5], dtype=torch.int32)  # 6 adapters in a plan for 2
    meta = build_lora_meta(broken, num_slots=8, block_m=4, use_kernel=use_kernel, max_adapters=2)
    assert meta.max_chunks == 2 + 2 and int(meta.num_chunks) == meta.max_chunks
