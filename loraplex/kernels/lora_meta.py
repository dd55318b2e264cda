"""Per-step LoRA kernel metadata, built on the device with no host sync.

The shrink/expand kernels see a batch whose tokens carry a GPU slot index (-1 = base model only).
Tokens are stably sorted by slot; each slot's run is cut into chunks of at most ``block_m`` tokens,
and every chunk becomes one program row of the kernel grid.

Shape:
    token_slots       [T] int32        slot per token, -1 = no adapter
    sorted_token_ids  [T] int32        token indices stably sorted by slot, base tokens last
    chunk_slots       [max_chunks] int32   slot of each chunk, -1 = unused chunk (program exits)
    chunk_starts      [max_chunks] int32   first position of the chunk in ``sorted_token_ids``
    chunk_lens        [max_chunks] int32   tokens in the chunk (0 for unused chunks)

``max_chunks = cdiv(T, block_m) + min(T, num_slots)`` depends only on T and the pool size (every slot's
run adds at most one partial chunk), so a CUDA graph captured for T replays correctly for any mix of
adapters: grids are sized from this maximum, never from a count seen at capture time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def max_chunks_for(num_tokens: int, num_slots: int, block_m: int) -> int:
    return -(-num_tokens // block_m) + min(num_tokens, num_slots)


@dataclass(frozen=True)
class LoRAKernelMeta:
    token_slots: torch.Tensor  # [T] int32
    sorted_token_ids: torch.Tensor  # [T] int32
    chunk_slots: torch.Tensor  # [max_chunks] int32
    chunk_starts: torch.Tensor  # [max_chunks] int32
    chunk_lens: torch.Tensor  # [max_chunks] int32
    num_slots: int
    block_m: int

    @property
    def num_tokens(self) -> int:
        return self.token_slots.shape[0]

    @property
    def max_chunks(self) -> int:
        return self.chunk_slots.shape[0]


def build_lora_meta(token_slots: torch.Tensor, num_slots: int, block_m: int) -> LoRAKernelMeta:
    """Group tokens by slot and cut each slot's run into chunks of ``block_m``. Device ops only."""
    assert token_slots.dim() == 1, "token_slots must be [T]"
    assert block_m >= 1 and num_slots >= 1
    device = token_slots.device
    num_tokens = token_slots.shape[0]
    slots = token_slots.to(torch.int64)
    # base tokens (-1) sort after every slot and are never part of a chunk
    key = torch.where(slots < 0, torch.full_like(slots, num_slots), slots)
    sorted_ids = torch.argsort(key, stable=True)
    counts = torch.zeros(num_slots + 1, dtype=torch.int64, device=device)
    counts.index_add_(0, key, torch.ones_like(key))  # bincount would sync on CUDA
    counts = counts[:num_slots]
    seg_starts = torch.cumsum(counts, 0) - counts
    num_chunks = (counts + block_m - 1) // block_m
    chunk_end = torch.cumsum(num_chunks, 0)  # inclusive: chunks of slots 0..s
    chunk_begin = chunk_end - num_chunks
    max_chunks = max_chunks_for(num_tokens, num_slots, block_m)
    chunk_ids = torch.arange(max_chunks, dtype=torch.int64, device=device)
    chunk_slot = torch.searchsorted(chunk_end, chunk_ids, right=True)
    valid = chunk_slot < num_slots
    slot_c = chunk_slot.clamp(max=num_slots - 1)
    local = chunk_ids - chunk_begin[slot_c]
    starts = seg_starts[slot_c] + local * block_m
    lens = torch.clamp(counts[slot_c] - local * block_m, max=block_m)
    zero = torch.zeros_like(starts)
    return LoRAKernelMeta(
        token_slots=slots.to(torch.int32),
        sorted_token_ids=sorted_ids.to(torch.int32),
        chunk_slots=torch.where(valid, slot_c, torch.full_like(slot_c, -1)).to(torch.int32),
        chunk_starts=torch.where(valid, starts, zero).to(torch.int32),
        chunk_lens=torch.where(valid, lens, zero).to(torch.int32),
        num_slots=num_slots,
        block_m=block_m,
    )
