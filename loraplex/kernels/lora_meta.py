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
    num_chunks        [1] int32            chunks in use; they are the first ``num_chunks`` entries
    chunk_tokens      [max_chunks, block_m] int32   the chunk's token indices, -1 past its length (one load
                                           gives a program its tokens, instead of start -> sorted ids)

``max_chunks = cdiv(T, block_m) + min(T, num_slots)`` depends only on T and the pool size (every slot's
run adds at most one partial chunk), so a CUDA graph captured for T replays correctly for any mix of
adapters: grids are sized from this maximum, never from a count seen at capture time. The kernels read
``num_chunks`` on the device to spread their fixed grid over the chunks actually in use (one adapter:
a few chunks, each served by many programs; distinct adapters: one program row per chunk).

Two builders with the same result: ``build_lora_meta_torch`` (device torch ops, ~30 small kernels on CUDA)
and, on CUDA for decode-sized batches, one single-program Triton kernel (``_lora_meta_kernel``): inside a
decode CUDA graph every launch costs a few microseconds, so one launch instead of ~30 per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from loraplex.kernels.host_math import next_power_of_2
from loraplex.kernels.launch import fast_launch


def max_chunks_for(num_tokens: int, num_slots: int, block_m: int, max_adapters: int | None = None) -> int:
    """Chunks a step of ``num_tokens`` may need: every slot's run adds at most one partial chunk, and at most
    ``min(num_tokens, num_slots, max_adapters)`` slots have a run (``max_adapters``: a host-known bound on the step's
    distinct adapters, None: none)."""
    runs = min(num_tokens, num_slots) if max_adapters is None else min(num_tokens, num_slots, max(1, max_adapters))
    return -(-num_tokens // block_m) + runs


@dataclass(frozen=True)
class LoRAKernelMeta:
    token_slots: torch.Tensor  # [T] int32
    sorted_token_ids: torch.Tensor  # [T] int32
    chunk_slots: torch.Tensor  # [max_chunks] int32
    chunk_starts: torch.Tensor  # [max_chunks] int32
    chunk_lens: torch.Tensor  # [max_chunks] int32
    num_slots: int
    block_m: int
    num_chunks: torch.Tensor | None = None  # [1] int32: chunks in use (the first ones); None = all may be
    chunk_tokens: torch.Tensor | None = None  # [max_chunks, block_m] int32, -1 = no token

    @property
    def num_tokens(self) -> int:
        return self.token_slots.shape[0]

    @property
    def max_chunks(self) -> int:
        return self.chunk_slots.shape[0]


# the single-program builder handles up to this many tokens / slots (decode buckets); larger steps (prefill)
# use the torch ops, whose launch count is small next to their kernels
META_KERNEL_MAX_TOKENS = 1024
META_KERNEL_MAX_SLOTS = 1024


def build_lora_meta(token_slots: torch.Tensor, num_slots: int, block_m: int,
                    use_kernel: bool | None = None, max_adapters: int | None = None) -> LoRAKernelMeta:
    """Group tokens by slot and cut each slot's run into chunks of ``block_m``. Device ops only.

    ``use_kernel``: the single-launch Triton builder (default: on CUDA when the sizes allow it).
    ``max_adapters``: the caller's promise that the step has at most this many distinct slots (``bench lora_plan``'s
    plans for few adapters; the engine passes none, run 28 measured such plans slower): the tables then hold
    ``max_chunks_for(..., max_adapters)`` chunks, so every grid sized from them is smaller. A step that breaks the
    promise loses its last chunks (``num_chunks`` is clamped to the tables, so no kernel reads past them): callers
    check the count on the host first."""
    assert token_slots.dim() == 1, "token_slots must be [T]"
    assert block_m >= 1 and num_slots >= 1
    num_tokens = token_slots.shape[0]
    fits = (0 < num_tokens <= META_KERNEL_MAX_TOKENS and num_slots <= META_KERNEL_MAX_SLOTS
            and block_m & (block_m - 1) == 0 and block_m <= 128)
    if use_kernel is None:
        use_kernel = token_slots.is_cuda and fits
    if use_kernel and fits:
        return _build_lora_meta_kernel(token_slots, num_slots, block_m, max_adapters)
    return build_lora_meta_torch(token_slots, num_slots, block_m, max_adapters)


def build_lora_meta_torch(token_slots: torch.Tensor, num_slots: int, block_m: int,
                          max_adapters: int | None = None) -> LoRAKernelMeta:
    """Reference builder in torch ops (also the path for large batches and the CPU twins)."""
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
    max_chunks = max_chunks_for(num_tokens, num_slots, block_m, max_adapters)
    chunk_ids = torch.arange(max_chunks, dtype=torch.int64, device=device)
    chunk_slot = torch.searchsorted(chunk_end, chunk_ids, right=True)
    valid = chunk_slot < num_slots
    slot_c = chunk_slot.clamp(max=num_slots - 1)
    local = chunk_ids - chunk_begin[slot_c]
    starts = seg_starts[slot_c] + local * block_m
    lens = torch.clamp(counts[slot_c] - local * block_m, max=block_m)
    zero = torch.zeros_like(starts)
    lens = torch.where(valid, lens, zero)
    starts = torch.where(valid, starts, zero)
    offs = torch.arange(block_m, dtype=torch.int64, device=device)
    pos = (starts[:, None] + offs[None, :]).clamp(max=max(num_tokens - 1, 0))
    tokens = torch.where(offs[None, :] < lens[:, None], sorted_ids[pos] if num_tokens else pos,
                         torch.full_like(pos, -1))
    return LoRAKernelMeta(
        token_slots=slots.to(torch.int32),
        sorted_token_ids=sorted_ids.to(torch.int32),
        chunk_slots=torch.where(valid, slot_c, torch.full_like(slot_c, -1)).to(torch.int32),
        chunk_starts=starts.to(torch.int32),
        chunk_lens=lens.to(torch.int32),
        num_slots=num_slots,
        block_m=block_m,
        num_chunks=(chunk_end[-1:] if max_adapters is None else chunk_end[-1:].clamp(max=max_chunks)).to(torch.int32),
        chunk_tokens=tokens.to(torch.int32),
    )


UNSPECIALIZED = ("T", "NUM_SLOTS", "MAX_CHUNKS")  # no variant per token count (TB, CB: one per power of 2)


@fast_launch
@triton.jit(do_not_specialize=UNSPECIALIZED)
def _lora_meta_kernel(
    slots_ptr, sorted_ptr, chunk_slots_ptr, chunk_starts_ptr, chunk_lens_ptr, num_chunks_ptr, seg_ptr,
    chunk_tokens_ptr,
    T, NUM_SLOTS, MAX_CHUNKS,
    BLOCK_M: tl.constexpr, TB: tl.constexpr, SB: tl.constexpr, CB: tl.constexpr, UB: tl.constexpr,
):
    """One program. key(t) = slot, or NUM_SLOTS for base tokens; position of t in the stable sort =
    #(key < key(t)) + #(key == key(t) and index < t), counted by comparison over blocks of UB tokens.
    Per slot: count, first sorted position, chunks (cumulative sums); per chunk: the slot whose chunk range
    holds it (one-hot over slots). ``seg_ptr`` is an int32 scratch of 4 * SB (per-slot tables, re-read by
    chunk blocks after a barrier)."""
    offs_t = tl.arange(0, TB)
    t_mask = offs_t < T
    s_t = tl.load(slots_ptr + offs_t, mask=t_mask, other=-1)
    key_t = tl.where(s_t < 0, NUM_SLOTS, s_t)
    pos = tl.zeros((TB,), dtype=tl.int32)
    offs_u = tl.arange(0, UB)
    for u0 in range(0, TB, UB):
        u = u0 + offs_u
        s_u = tl.load(slots_ptr + u, mask=u < T, other=-1)
        key_u = tl.where(s_u < 0, NUM_SLOTS, s_u)
        before = (key_u[None, :] < key_t[:, None]) | ((key_u[None, :] == key_t[:, None]) & (u[None, :] < offs_t[:, None]))
        before = before & (u < T)[None, :]
        pos += tl.sum(before.to(tl.int32), axis=1)
    tl.store(sorted_ptr + pos, offs_t, mask=t_mask)

    # per slot: tokens, first sorted position, chunk range
    offs_s = tl.arange(0, SB)
    counts = tl.zeros((SB,), dtype=tl.int32)
    for u0 in range(0, TB, UB):
        u = u0 + offs_u
        s_u = tl.load(slots_ptr + u, mask=u < T, other=-1)
        hit = (s_u[None, :] == offs_s[:, None]) & (u < T)[None, :]
        counts += tl.sum(hit.to(tl.int32), axis=1)
    counts = tl.where(offs_s < NUM_SLOTS, counts, 0)
    seg_start = tl.cumsum(counts, axis=0) - counts
    n_chunks = (counts + BLOCK_M - 1) // BLOCK_M
    chunk_end = tl.cumsum(n_chunks, axis=0)
    chunk_begin = chunk_end - n_chunks
    tl.store(num_chunks_ptr, tl.minimum(tl.sum(n_chunks, axis=0), MAX_CHUNKS))  # MAX_CHUNKS: a broken max_adapters
    # the chunk loop below needs these per slot in every lane: through memory (no register gather)
    tl.store(seg_ptr + offs_s, chunk_begin)
    tl.store(seg_ptr + SB + offs_s, chunk_end)
    tl.store(seg_ptr + 2 * SB + offs_s, seg_start)
    tl.store(seg_ptr + 3 * SB + offs_s, counts)
    tl.debug_barrier()

    offs_c = tl.arange(0, CB)
    offs_j = tl.arange(0, BLOCK_M)
    begin_s = tl.load(seg_ptr + offs_s)
    end_s = tl.load(seg_ptr + SB + offs_s)
    start_s = tl.load(seg_ptr + 2 * SB + offs_s)
    count_s = tl.load(seg_ptr + 3 * SB + offs_s)
    for c0 in range(0, MAX_CHUNKS, CB):
        c = c0 + offs_c
        inside = (begin_s[None, :] <= c[:, None]) & (c[:, None] < end_s[None, :])  # at most one slot per chunk
        valid = tl.sum(inside.to(tl.int32), axis=1) > 0
        slot = tl.sum(tl.where(inside, offs_s[None, :], 0), axis=1)
        first = tl.sum(tl.where(inside, begin_s[None, :], 0), axis=1)
        seg = tl.sum(tl.where(inside, start_s[None, :], 0), axis=1)
        cnt = tl.sum(tl.where(inside, count_s[None, :], 0), axis=1)
        local = (c - first) * BLOCK_M
        c_mask = c < MAX_CHUNKS
        tl.store(chunk_slots_ptr + c, tl.where(valid, slot, -1), mask=c_mask)
        tl.store(chunk_starts_ptr + c, tl.where(valid, seg + local, 0), mask=c_mask)
        length = tl.where(valid, tl.minimum(cnt - local, BLOCK_M), 0)
        tl.store(chunk_lens_ptr + c, length, mask=c_mask)
        # the chunk's tokens (sorted ids stored above, before the barrier), -1 past its length
        in_chunk = (offs_j[None, :] < length[:, None]) & c_mask[:, None]
        toks = tl.load(sorted_ptr + (seg + local)[:, None] + offs_j[None, :], mask=in_chunk, other=-1)
        tl.store(chunk_tokens_ptr + c[:, None] * BLOCK_M + offs_j[None, :], toks, mask=c_mask[:, None])


def _build_lora_meta_kernel(token_slots: torch.Tensor, num_slots: int, block_m: int,
                            max_adapters: int | None = None) -> LoRAKernelMeta:
    device = token_slots.device
    num_tokens = token_slots.shape[0]
    slots = token_slots if token_slots.dtype == torch.int32 and token_slots.is_contiguous() else \
        token_slots.to(torch.int32).contiguous()
    max_chunks = max_chunks_for(num_tokens, num_slots, block_m, max_adapters)
    sb = max(16, next_power_of_2(num_slots))
    # one allocation for every output (a single caching-allocator call; the kernel writes every entry); each
    # table starts 16-byte aligned whatever the sizes, so the kernels reading them are never compiled again
    # for another alignment (Triton specializes pointer arguments on it)
    sizes = (max_chunks * block_m, num_tokens, max_chunks, max_chunks, max_chunks, 1, 4 * sb)
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + -(-n // 4) * 4)
    buf = torch.empty(starts[-1], dtype=torch.int32, device=device)
    chunk_tokens, sorted_ids, chunk_slots, chunk_starts, chunk_lens, num_chunks, seg = (
        buf[o:o + n] for o, n in zip(starts, sizes))
    chunk_tokens = chunk_tokens.view(max_chunks, block_m)
    tb = max(16, next_power_of_2(num_tokens))
    ub = max(1, min(tb, 4096 // tb, 8192 // sb))  # [TB, UB] and [SB, UB] compare tiles stay small
    ub = max(16, ub)
    cb = max(16, min(next_power_of_2(max_chunks), 8192 // max(sb, block_m)))
    _lora_meta_kernel[(1,)](
        slots, sorted_ids, chunk_slots, chunk_starts, chunk_lens, num_chunks, seg, chunk_tokens,
        num_tokens, num_slots, max_chunks,
        BLOCK_M=block_m, TB=tb, SB=sb, CB=cb, UB=ub, num_warps=4 if tb <= 256 else 8,
    )
    return LoRAKernelMeta(token_slots=slots, sorted_token_ids=sorted_ids, chunk_slots=chunk_slots,
                          chunk_starts=chunk_starts, chunk_lens=chunk_lens, num_slots=num_slots, block_m=block_m,
                          num_chunks=num_chunks, chunk_tokens=chunk_tokens)


def check_apply_args(x, out, lora_a, lora_b, ranks, scaling, slice_loc, meta: LoRAKernelMeta) -> tuple[int, int, int, int]:
    """The shapes, dtypes and layouts a one-launch LoRA apply (``lora_fused``, ``lora_ticketed``) needs:
    x [T, K], out [T, N_total], lora_a [num_slots, S, R, K], lora_b [num_slots, R, N_total], ranks [S, num_slots] int32,
    scaling [num_slots] float32, slice_loc [S + 1] int32, metadata of T tokens and num_slots slots. Returns
    (T, K, S, R)."""
    num_tokens, k_dim = x.shape
    num_slots, num_slices, max_rank, a_k = lora_a.shape
    assert a_k == k_dim, f"x has K={k_dim}, lora_a has K={a_k}"
    assert lora_b.shape[:2] == (num_slots, max_rank), f"lora_b is {tuple(lora_b.shape)}"
    n_total = lora_b.shape[2]
    assert out.shape == (num_tokens, n_total), f"out is {tuple(out.shape)}, want ({num_tokens}, {n_total})"
    assert x.dtype == lora_a.dtype == lora_b.dtype == out.dtype, "x, weights and out share one dtype"
    assert x.stride(1) == 1 and lora_a.stride(3) == 1 and lora_b.stride(2) == 1
    assert ranks.shape == (num_slices, num_slots) and ranks.dtype == torch.int32 and ranks.stride(1) == 1
    assert slice_loc.shape == (num_slices + 1,) and slice_loc.dtype == torch.int32
    assert scaling.dtype == torch.float32
    assert meta.num_tokens == num_tokens and meta.num_slots == num_slots
    return num_tokens, k_dim, num_slices, max_rank
