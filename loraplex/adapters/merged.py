"""Single-adapter stretches on merged weights: while every token of every step uses one adapter, that adapter's
delta is folded into the base weights (``W = W0 + s B A`` for each of its projections) and the steps run as the
base model: no LoRA kernels, no expand read and write of the outputs, the base decode graphs.

A LoRA step costs the base model's step plus, per projection, a shrink and an expand that reads and writes the
whole output. When one adapter has the GPU to itself (one tenant's batch job, a dedicated deployment, the
identical-popularity workload) that is all overhead: measured on an H200, a prompt step of ~7k tokens pays
about 8% for it (the expand's read and write of the outputs) and a decode step at batch 248 about 4%. On merged
weights both are gone.

Policy (``MergedLoRA.step``, called once per engine step before its forward):
- a step "wants" the merge when it has exactly one adapter and no base token; the adapter is named by its slot
  and the slot's fill version, so a slot refilled with another adapter is another adapter;
- the merge happens once ``threshold`` consecutive such steps of the same adapter have run (start
  ``min_steps``), or as soon as they hold ``threshold * tokens_per_step`` tokens, this step's included: a merge
  costs about one pass over the projection weights, which a prompt step of a few thousand tokens saves at
  once (its expand reads and writes every output) while a decode step saves a fraction of it;
- any other step (base tokens, another adapter, several adapters, a refilled slot) first restores the pristine
  weights, then runs as usual; a merge that lasted fewer than ``threshold`` steps doubles the threshold (up to
  ``max_steps``) and one that lasted ``4 * threshold`` halves it, so an alternating workload settles on the
  kernel path instead of re-merging every few steps.

Exactness: the pristine weights ``W0`` are kept on the device (one copy of the projection weights, about the
model's size: the option costs that much KV cache), so un-merging is a copy and base tokens after it see
bit-identical weights; no tenant's adapter ever perturbs another tenant's numbers. The merge is one
``addmm`` per projection slice (fp32 accumulation, one rounding to the weight dtype), a pass over the
projection weights, queued on the current stream after the step before it: nothing waits on the host. The
merged step's logits equal the kernel path's up to that rounding (bit-for-bit in fp32 up to summation order).

Off unless the engine is started with ``merge_single_lora``.
"""

from __future__ import annotations

import torch

from loraplex.adapters.modules import PROJ_MODULES

WEIGHT_OF = {"qkv": "qkv_weight", "o": "o_weight", "gate_up": "gate_up_weight", "down": "down_weight"}


def check_room(need: int, free: int, headroom: int = 1 << 30) -> None:
    """The pristine copy must fit with ``headroom`` to spare (before the KV cache is sized from what is left)."""
    if need + headroom > free:
        raise ValueError(f"merge_single_lora keeps a copy of the projection weights on the GPU: {need / 2**30:.1f} GiB "
                         f"(+{headroom / 2**30:.0f} GiB headroom) needed, {free / 2**30:.1f} GiB free; start without "
                         "merge_single_lora or on a larger GPU")


class MergedLoRA:
    def __init__(self, model, pool, min_steps: int = 8, max_steps: int = 1024, tokens_per_step: int = 512) -> None:
        if min_steps < 1 or max_steps < min_steps:
            raise ValueError(f"need 1 <= min_steps <= max_steps, got {min_steps}, {max_steps}")
        self.pool = pool
        self.min_steps, self.max_steps = min_steps, max_steps
        self.tokens_per_step = tokens_per_step
        self.threshold = min_steps
        layers = list(model.layers)
        self.weights = {proj: [getattr(layer, name) for layer in layers] for proj, name in WEIGHT_OF.items()}
        need = sum(w.numel() * w.element_size() for ws in self.weights.values() for w in ws)
        device = self.weights["qkv"][0].device
        if device.type == "cuda":
            check_room(need, torch.cuda.mem_get_info(device)[0])
        with torch.no_grad():
            self.pristine = {proj: [w.detach().clone() for w in ws] for proj, ws in self.weights.items()}
        self.merged: tuple[int, int] | None = None  # (slot, fill version) folded into the weights
        self._candidate: tuple[int, int] | None = None
        self._run = 0  # consecutive steps that wanted ``_candidate``
        self._run_tokens = 0  # and their tokens
        self._held = 0  # steps run on the current merge
        self.num_merges = 0
        self.num_unmerges = 0
        self.num_merged_steps = 0

    def step(self, slot_of: dict[int, int] | None, has_base: bool, num_tokens: int = 1) -> bool:
        """Called once per engine step with its adapters (adapter id -> slot, slots assigned; None or empty: no
        adapter), whether any token uses none and its token count. Merges or restores the weights as the policy says (queued on
        the current stream) and returns whether the step runs on merged weights, i.e. as the base model with no
        LoRA work."""
        key = None
        if slot_of and len(slot_of) == 1 and not has_base:
            (slot,) = slot_of.values()
            key = (slot, self.pool.fill_version[slot])
        if key is not None and key == self._candidate:
            self._run += 1
            self._run_tokens += num_tokens
        else:
            self._candidate, self._run, self._run_tokens = key, 1, num_tokens
        if self.merged is not None and key != self.merged:
            self.unmerge()
        if key is not None and self.merged is None and (
                self._run >= self.threshold or self._run_tokens >= self.threshold * self.tokens_per_step):
            self.merge(key[0])
        if self.merged is None:
            return False
        self._held += 1
        self.num_merged_steps += 1
        return True

    @torch.no_grad()
    def merge(self, slot: int) -> None:
        """Fold the adapter in ``slot`` into the projection weights: ``W = W0 + s B A`` per slice, rows past each
        module's rank left out (they may hold a previous occupant's values)."""
        assert self.merged is None, "restore the weights before merging another adapter"
        pool, r = self.pool, self.pool.max_rank
        pool.wait_for_fills([slot])
        rows = torch.arange(r, device=pool.ranks.device)
        for proj, mods in PROJ_MODULES.items():
            lo, hi = pool.module_range[proj]
            keep = rows[None, None, :] < pool.ranks[:, lo:hi, slot][:, :, None]  # [L, S, R]
            # s B^T with rows past the rank zeroed, in the weights' dtype (one rounding of the small factor)
            bt = pool.bt[proj][:, slot].float() * pool.scaling[slot]  # [L, R, N]
            loc = pool.slice_loc_host[proj]
            for layer, (w, w0) in enumerate(zip(self.weights[proj], self.pristine[proj])):
                for j in range(len(mods)):
                    n0, n1 = loc[j], loc[j + 1]
                    b = (bt[layer, :, n0:n1] * keep[layer, j][:, None]).to(w.dtype).t()  # [n, R]
                    torch.addmm(w0[n0:n1], b, pool.a[proj][layer, slot, j], out=w[n0:n1])
        self.merged = (slot, pool.fill_version[slot])
        self._held = 0
        self.num_merges += 1

    @torch.no_grad()
    def unmerge(self) -> None:
        """Restore the pristine weights (a copy: bit-identical) and adapt the merge threshold."""
        if self.merged is None:
            return
        for proj, ws in self.weights.items():
            for w, w0 in zip(ws, self.pristine[proj]):
                w.copy_(w0)
        if self._held < self.threshold:
            self.threshold = min(self.max_steps, 2 * self.threshold)
        elif self._held >= 4 * self.threshold:
            self.threshold = max(self.min_steps, self.threshold // 2)
        self.merged = None
        self.num_unmerges += 1
