"""Device-built LoRA metadata: tokens grouped by slot, chunks of fixed maximum count."""

from __future__ import annotations

import torch

from loraplex.kernels.lora_meta import build_lora_meta, max_chunks_for


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


def test_all_base_and_empty_batches():
    meta = build_lora_meta(torch.full((5,), -1, dtype=torch.int32), num_slots=4, block_m=16)
    assert (meta.chunk_slots == -1).all() and meta.max_chunks == 1 + 4
    empty = build_lora_meta(torch.zeros(0, dtype=torch.int32), num_slots=4, block_m=16)
    assert empty.max_chunks == 0
