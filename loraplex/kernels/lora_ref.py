"""Pure-torch reference twins of the LoRA shrink/expand kernels (also the engine's CPU path).

Weight layout, per layer and fused projection (``S`` slices share the input, e.g. q|k|v or gate|up):

    lora_a   [num_slots, S, R, K]        A of slot l, slice s; rows r < rank[s, l] are real (packed first)
    lora_b   [num_slots, R, N_total]     B transposed; slice s owns columns slice_loc[s]:slice_loc[s+1]
    ranks    [S, num_slots] int32        real rank per slice and slot (0 = the adapter skips this module)
    scaling  [num_slots] float32         lora_alpha / r   (lora_alpha / sqrt(r) with use_rslora)

``R`` is the pool's max rank; nothing beyond a slot's real rank is ever read.
"""

from __future__ import annotations

import torch


def _slot_rows(token_slots: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    slots = token_slots.to(torch.int64)
    return [(int(s), torch.nonzero(slots == s).flatten()) for s in torch.unique(slots).tolist() if s >= 0]


def lora_shrink_ref(
    x: torch.Tensor,  # [T, K]
    lora_a: torch.Tensor,  # [num_slots, S, R, K]
    token_slots: torch.Tensor,  # [T] int, -1 = no adapter
    ranks: torch.Tensor,  # [S, num_slots] int
) -> torch.Tensor:  # [S, T, R] float32
    """Semantics: for every token t with slot l = token_slots[t] >= 0, slice s, r < rank[s, l]:

        y[s, t, r] = sum_k x[t, k] * lora_a[l, s, r, k]          (accumulated in float32)

    every other entry of y is 0.
    """
    num_slices, max_rank = lora_a.shape[1], lora_a.shape[2]
    y = torch.zeros(num_slices, x.shape[0], max_rank, dtype=torch.float32, device=x.device)
    rank_table = ranks.tolist()
    for slot, rows in _slot_rows(token_slots):
        xs = x[rows].float()
        for s in range(num_slices):
            r = rank_table[s][slot]
            if r:
                y[s, rows, :r] = xs @ lora_a[slot, s, :r].float().T
    return y


def gemm_shrink_y(
    full: torch.Tensor,  # [T, N + num_slots * S * R]: x @ [W; A of every slot].T (``SlotPool.fold_base_weights``)
    n: int,  # base output columns
    token_slots: torch.Tensor,  # [T] int, -1 = no adapter
    num_slices: int,
    max_rank: int,
) -> torch.Tensor:  # [S, T, R] float32
    """The shrink's y from the folded GEMM's extra columns: token t with slot l >= 0 reads columns
    ``n + (l * S + s) * R + r``; rows of slot -1 tokens are 0. Entries beyond a slot's rank are whatever the GEMM
    made of the rows there (the expand never reads them)."""
    slots = token_slots.to(torch.int64)
    groups = full[:, n:].reshape(full.shape[0], -1, num_slices, max_rank)  # [T, num_slots, S, R]
    picked = groups[torch.arange(full.shape[0], device=full.device), slots.clamp(min=0)]  # [T, S, R]
    picked = torch.where((slots >= 0)[:, None, None], picked.float(), torch.zeros((), device=full.device))
    return picked.permute(1, 0, 2).contiguous()


def lora_expand_ref(
    y: torch.Tensor,  # [S, T, R] float32 (the shrink output)
    lora_b: torch.Tensor,  # [num_slots, R, N_total]
    token_slots: torch.Tensor,  # [T] int, -1 = no adapter
    ranks: torch.Tensor,  # [S, num_slots] int
    scaling: torch.Tensor,  # [num_slots] float32
    slice_loc: list[int] | torch.Tensor,  # [S + 1] column offsets of the slices in out
    out: torch.Tensor,  # [T, N_total], updated in place
    accumulate: bool = True,
    zero_base: bool = False,
) -> torch.Tensor:
    """Semantics: for every token t with slot l = token_slots[t] >= 0 and slice s with r = rank[s, l] > 0,
    columns n in [slice_loc[s], slice_loc[s+1]):

        out[t, n] = cast(float32(out[t, n]) + scaling[l] * sum_{j<r} y[s, t, j] * lora_b[l, j, n])

    The product runs in float32 and is added once. Rows of tokens with slot -1 are not touched
    (bit-identical), nor are slices an adapter does not target.

    ``accumulate=False``: out is not read; those rows get ``cast(scaling[l] * sum_j ...)``, and zeros in the
    slices their adapter does not target (rank 0); rows of slot -1 tokens are still not touched, or with
    ``zero_base`` set to zero.
    """
    assert not (zero_base and accumulate), "zero_base needs accumulate=False"
    if zero_base:
        out[token_slots < 0] = 0
    loc = slice_loc.tolist() if torch.is_tensor(slice_loc) else list(slice_loc)
    rank_table = ranks.tolist()
    scales = scaling.tolist()
    for slot, rows in _slot_rows(token_slots):
        for s in range(len(loc) - 1):
            r = rank_table[s][slot]
            lo, hi = loc[s], loc[s + 1]
            if not r:
                if not accumulate:
                    out[rows, lo:hi] = 0
                continue
            delta = (y[s, rows, :r] @ lora_b[slot, :r, lo:hi].float()) * scales[slot]
            base = out[rows, lo:hi].float() if accumulate else 0.0
            out[rows, lo:hi] = (base + delta).to(out.dtype)
    return out


def lora_apply_ref(
    x: torch.Tensor,  # [T, K]
    out: torch.Tensor,  # [T, N_total], updated in place
    lora_a: torch.Tensor,  # [num_slots, S, R, K]
    lora_b: torch.Tensor,  # [num_slots, R, N_total]
    token_slots: torch.Tensor,  # [T] int
    ranks: torch.Tensor,  # [S, num_slots] int
    scaling: torch.Tensor,  # [num_slots] float32
    slice_loc: list[int] | torch.Tensor,  # [S + 1]
) -> torch.Tensor:
    """Semantics: out[t, slice s] += scaling[l] * (x[t] @ A[l, s, :r].T) @ B[l, :r, slice s], l = slot of t.

    This is PEFT's ``base(x) + lora_B(lora_A(x)) * scaling`` for every slice of a fused projection.
    """
    y = lora_shrink_ref(x, lora_a, token_slots, ranks)
    return lora_expand_ref(y, lora_b, token_slots, ranks, scaling, slice_loc, out)
