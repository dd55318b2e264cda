"""Single-adapter steps as one GEMM per projection: the adapter's B is folded into the base weight.

A step whose tokens all use one adapter (or none) computes ``out = x W^T + s (x A^T) B`` as

    out = [x | y] @ [W | s B^T]^T,      y = (x A^T) for the adapter's tokens, 0 for base tokens

The base weight is allocated with ``S * R`` spare columns (S slices of the projection, R = max_lora_rank;
``LlamaForCausalLM(..., lora_pad=...)``), so the model's parameter is the ``[:, :K]`` view of ``[N, K + S R]``
and base-only GEMMs read exactly the bytes they did (cuBLAS takes the row stride). The spare columns hold the
active adapter's scaled B, block-diagonal by slice (slice j's rows of W see only y's j-th R columns), with
zeros past its rank. The expand then costs the GEMM S R / K more work (about 1% for rank 16) instead of a
separate read and write of the whole output, which is most of a LoRA step's memory traffic when few adapters
are live.

``DenseLoRA.ensure(slot)`` lays out an adapter (device ops only, no host sync); it runs when the step's single
adapter differs from the one laid out, at most once every ``min_steps_between`` steps (a workload that
alternates adapters keeps the kernel path instead of re-laying weights every step). Off unless the engine is
started with ``dense_single_lora``.

Cost per projection: the base GEMM over K + S R columns plus the shrink ``x A^T``, written straight into the
wide input, against the kernel path's shrink and expand (which reads and writes the whole output). The kernels
that produce x (the fused RMSNorm before qkv and gate|up, SiLU-and-multiply before down) write it into the wide
input themselves (``LoRAStep.input_buffer``); only o's input (the attention output) is copied in. A step with
base tokens beside the adapter's also masks their y rows (one more small kernel). Not yet measured on a GPU: by
estimate one small GEMM per projection (~3 us in a graph, 128 a step) against the kernel path's two kernels and
the output's read and write.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loraplex.adapters.modules import PROJ_MODULES

WEIGHT_OF = {"qkv": "qkv_weight", "o": "o_weight", "gate_up": "gate_up_weight", "down": "down_weight"}


def lora_pad(max_rank: int) -> dict[str, int]:
    """Spare weight columns per projection: one block of ``max_rank`` per slice."""
    return {proj: len(mods) * max_rank for proj, mods in PROJ_MODULES.items()}


class DenseLoRA:
    def __init__(self, model, pool, min_steps_between: int = 16) -> None:
        self.pool = pool
        self.rank = pool.max_rank
        self.pad = lora_pad(self.rank)  # spare columns per proj
        self.min_steps_between = min_steps_between
        layers = list(model.layers)
        self.weights: dict[str, list[torch.Tensor]] = {}  # proj -> per layer [N, K + S R] (the param is [:, :K])
        for proj, name in WEIGHT_OF.items():
            full = []
            for layer in layers:
                w = getattr(layer, name)
                k, pad = w.shape[1], self.pad[proj]
                assert w.stride(0) == k + pad and w.stride(1) == 1, (
                    f"{name} has no spare LoRA columns: build the model with lora_pad=lora_pad({self.rank})")
                full.append(w.as_strided((w.shape[0], k + pad), (k + pad, 1)))
            self.weights[proj] = full
        self.a = {p: torch.zeros(pool.a[p].shape[0], len(m) * self.rank, pool.a[p].shape[-1], dtype=pool.a[p].dtype,
                                 device=pool.a[p].device) for p, m in PROJ_MODULES.items()}  # [L, S R, K]
        self.slot: int | None = None  # the adapter laid out: (slot, fill version)
        self.version = -1
        self._steps_since_switch = min_steps_between
        self.num_layouts = 0
        self.num_dense_steps = 0  # steps that took the dense path
        self.num_inputs_in_place = 0  # projections whose x its producer wrote into the wide input (no copy)

    def want(self, slot: int) -> bool:
        """Whether a step whose only adapter sits in ``slot`` should take the dense path (laying it out if
        needed and allowed). Call once per such step."""
        self._steps_since_switch += 1
        current = self.slot == slot and self.version == self.pool.fill_version[slot]
        if not current:
            if self._steps_since_switch < self.min_steps_between:
                return False
            self.ensure(slot)
        self.num_dense_steps += 1
        return True

    @torch.no_grad()
    def ensure(self, slot: int) -> None:
        """Lay the adapter in ``slot`` into the spare columns and the dense A (queued on the current stream, after
        the slot's fill)."""
        pool, r = self.pool, self.rank
        if self.slot == slot and self.version == pool.fill_version[slot]:
            return
        pool.wait_for_fills([slot])
        rows = torch.arange(r, device=pool.ranks.device)
        for proj, mods in PROJ_MODULES.items():
            lo, hi = pool.module_range[proj]
            ranks = pool.ranks[:, lo:hi, slot]  # [L, S]
            keep = (rows[None, None, :] < ranks[:, :, None]).to(pool.a[proj].dtype)  # [L, S, R]
            a = pool.a[proj][:, slot] * keep[..., None]  # [L, S, R, K], zeros past each rank
            self.a[proj].copy_(a.flatten(1, 2))
            bt = pool.bt[proj][:, slot] * pool.scaling[slot].to(pool.bt[proj].dtype)  # [L, R, N]
            loc = pool.slice_loc_host[proj]
            for layer, full in enumerate(self.weights[proj]):
                block = full[:, full.shape[1] - self.pad[proj]:]
                block.zero_()
                for j in range(len(mods)):
                    n0, n1 = loc[j], loc[j + 1]
                    block[n0:n1, j * r:(j + 1) * r] = (bt[layer, :, n0:n1] * keep[layer, j][:, None]).T
        self.slot, self.version = slot, pool.fill_version[slot]
        self._steps_since_switch = 0
        self.num_layouts += 1

    def in_features(self, layer: int, proj: str) -> int:
        return self.weights[proj][layer].shape[1] - self.pad[proj]

    def wide_input(self, layer: int, proj: str, like: torch.Tensor) -> torch.Tensor:
        """An empty [T, K + S R] input of ``proj`` (x in the first K columns, y after)."""
        return torch.empty(like.shape[0], self.weights[proj][layer].shape[1], dtype=like.dtype, device=like.device)

    def linear(self, layer: int, proj: str, x: torch.Tensor, bias: torch.Tensor | None,
               has_adapter: torch.Tensor | None, x_aug: torch.Tensor | None = None) -> torch.Tensor:
        """``x W^T (+ bias)`` plus the laid-out adapter's delta on rows where ``has_adapter`` [T, 1] is 1 (None:
        on every row, as when the step has no base token; padding rows of a graph do not count). ``x_aug``: a
        ``wide_input`` whose first K columns already hold x (its producer wrote there), else x is copied in."""
        full = self.weights[proj][layer]
        k = x.shape[1]
        if x_aug is None:
            x_aug = self.wide_input(layer, proj, x)
            x_aug[:, :k] = x
        else:
            self.num_inputs_in_place += 1
        if has_adapter is None:
            torch.mm(x, self.a[proj][layer].t(), out=x_aug[:, k:])  # y straight into the wide buffer
        else:
            torch.mul(torch.mm(x, self.a[proj][layer].t()), has_adapter, out=x_aug[:, k:])
        return F.linear(x_aug, full, bias)
