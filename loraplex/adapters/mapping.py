"""Per-step LoRA mapping: which slot each token uses, and ``add()`` for the model's projections.

``LoRAStep.add(layer, proj, x, out)`` runs after each fused base projection and adds every token's own
adapter delta into ``out`` in place: Triton kernels on CUDA, the pure-torch twins elsewhere. Tokens of
base-model requests (slot -1) are left bit-identical.

``LoRAStep.linear`` (the base projection and its delta) can overlap the shrink with the base GEMM
(``overlap_shrink``, CUDA only): the shrink reads only x, so it runs on a forked stream while the GEMM runs,
and the expand follows both on the current stream. Both are short, memory-bound launches whose fixed latency
then hides under the GEMM instead of adding to the step.
"""

from __future__ import annotations

import dataclasses

import torch

from loraplex.adapters.modules import PROJ_MODULES
from loraplex.adapters.slot_pool import SlotPool
from loraplex.engine.quant import linear as base_linear  # a plain or an INT8 weight-only base weight


def token_slots_from_ids(token_adapter_ids: torch.Tensor, slot_of: dict[int, int]) -> torch.Tensor:
    """[T] adapter ids (0 = base) -> [T] int32 slots (-1 = base), on the ids' device, without a host sync."""
    device = token_adapter_ids.device
    if not slot_of:
        return torch.full(token_adapter_ids.shape, -1, dtype=torch.int32, device=device)
    ids = sorted(slot_of)
    table = torch.tensor([ids, [slot_of[i] for i in ids]], dtype=torch.int64)
    if device.type == "cuda":  # a pageable copy would wait for the GPU queue; a pinned one does not
        table = table.pin_memory().to(device, non_blocking=True)
    ids_t, slots_t = table[0], table[1].to(torch.int32)
    token_ids = token_adapter_ids.to(torch.int64)
    pos = torch.searchsorted(ids_t, token_ids).clamp(max=len(ids) - 1)
    hit = ids_t[pos] == token_ids
    return torch.where(hit, slots_t[pos], torch.full_like(slots_t[pos], -1))


def step_configs(shapes, max_loras: int, max_rank: int, num_tokens: int, num_active: int, pdl: bool,
                 long_tokens: int | None = None, max_adapters: int | None = None) -> dict:
    """Each projection's kernel configuration (``lora_ops.choose_config``) for a step of ``num_tokens`` tokens on
    ``num_active`` distinct adapters over a pool of ``max_loras`` slots of rank ``max_rank`` for a model of
    ``shapes`` (``BaseShapes``), from host-known sizes only. ``max_adapters``: a host-known bound on the step's
    distinct adapters that sizes the chunk tables and so every grid (None: the pool's slot count)."""
    from loraplex.kernels.lora_ops import choose_config

    budget = max_loras if max_adapters is None else max(1, min(max_loras, max_adapters))
    return {p: choose_config(num_tokens, num_active, budget, max_rank, shapes.proj_in(p), len(mods),
                             max(shapes.slice_widths(p)), pdl=pdl, long_tokens=long_tokens)
            for p, mods in PROJ_MODULES.items()}


def runs_expand_first(min_tokens: int, num_tokens: int) -> bool:
    """Whether a step of ``num_tokens`` runs its LoRA work before the base GEMM (engine option
    ``lora_expand_first_min_tokens``; 0: never). ``LoRAStep`` and the warm-up's keys ask the same question here."""
    return 0 < min_tokens <= num_tokens


def fuses_silu_mul(every_step: bool, min_tokens: int, num_tokens: int) -> bool:
    """Whether a step of ``num_tokens`` adds gate|up's delta inside SiLU-and-multiply (``fuse_lora_silu_mul`` for
    every step, or ``lora_silu_mul_min_tokens``; 0: never)."""
    return every_step or 0 < min_tokens <= num_tokens


def folds_shrink(max_tokens: int, num_tokens: int) -> bool:
    """Whether a step of ``num_tokens`` folds the down projection's shrink into SiLU-and-multiply (engine option
    ``lora_fold_shrink_max_tokens``; 0: never)."""
    return 0 < num_tokens <= max_tokens


@dataclasses.dataclass(frozen=True)
class StepKernelOptions:
    """The engine's LoRA options that choose a step's kernel variants (``LoRAManager`` holds them)."""
    max_loras: int
    max_rank: int
    pdl: bool = False
    expand_first_min_tokens: int = 0
    silu_mul_min_tokens: int = 0
    fuse_silu_mul: bool = False
    segment_tiles: bool = False
    fold_shrink_max_tokens: int = 0


def step_compile_key(shapes, opts: StepKernelOptions, num_tokens: int, num_active: int, has_base_tokens: bool,
                     long_tokens: int | None) -> tuple:
    """What makes Triton compile a variant for an eager LoRA step: each projection's compile-time constants
    (``lora_ops.compile_key``), whether it runs expand-first (and then whether base rows need zeros), and whether
    gate|up's delta goes inside SiLU-and-multiply. Steps with the same key run the same compiled kernels."""
    from loraplex.kernels.lora_ops import compile_key

    configs = step_configs(shapes, opts.max_loras, opts.max_rank, num_tokens, num_active, opts.pdl,
                           long_tokens if opts.segment_tiles else None)
    expand_first = runs_expand_first(opts.expand_first_min_tokens, num_tokens)
    fused = fuses_silu_mul(opts.fuse_silu_mul, opts.silu_mul_min_tokens, num_tokens)
    folds = folds_shrink(opts.fold_shrink_max_tokens, num_tokens) and not fused
    return (tuple(compile_key(c) for c in configs.values()), expand_first, fused,
            has_base_tokens or not expand_first, folds)


def warmup_steps(shapes, opts: StepKernelOptions, max_tokens: int) -> list[tuple[int, int, bool, int | None]]:
    """One eager step (tokens, distinct adapters, has_base_tokens, long_tokens) per ``step_compile_key`` that a step
    of at most ``max_tokens`` tokens can have, for the start-up warm-up (``ModelRunner.warmup_eager``).

    The key changes with the token count and the adapter count (tile regime; K parts, which follow the chunks in
    use and so grow with both), at the token thresholds of the expand-first order and the fused SiLU, and with
    base rows in the expand-first order. A grid of token counts (powers of two, each threshold and one below it,
    ``max_tokens`` and one below) by every adapter count up to ``max_loras`` meets every key; each key's largest
    step of the grid stands for it. With ``segment_tiles`` each step is tried with no token and with every token
    in long requests. The in-GEMM shrink's eager steps are not covered. Host arithmetic only."""
    from loraplex.kernels.lora_ops import PREFILL_TILES_MIN_TOKENS

    if max_tokens < 1:
        return []
    thresholds = (PREFILL_TILES_MIN_TOKENS, opts.expand_first_min_tokens, opts.silu_mul_min_tokens,
                  opts.fold_shrink_max_tokens + 1)
    token_counts = {max_tokens, max(1, max_tokens - 1)} | {1 << i for i in range(max_tokens.bit_length())}
    token_counts |= {t - d for t in thresholds for d in (0, 1) if 1 <= t - d <= max_tokens}
    chosen: dict[tuple, tuple[int, int, bool, int | None]] = {}
    for num_tokens in sorted(token_counts):
        for num_active in range(1, min(num_tokens, opts.max_loras) + 1):
            for long_tokens in ((None, num_tokens) if opts.segment_tiles else (None,)):
                key = step_compile_key(shapes, opts, num_tokens, num_active, True, long_tokens)
                chosen[key] = (num_tokens, num_active, True, long_tokens)
                if key[1]:  # expand-first: without base rows, the expand zeroes none (another variant)
                    key = step_compile_key(shapes, opts, num_tokens, num_active, False, long_tokens)
                    chosen[key] = (num_tokens, num_active, False, long_tokens)
    return sorted(set(chosen.values()), key=lambda c: (c[0], c[1], c[2], c[3] or 0))


_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """One forked stream per CUDA device for the overlapped shrinks (created once, reused by every step and graph)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _SIDE_STREAMS.get(index)
    if stream is None:
        stream = _SIDE_STREAMS[index] = torch.cuda.Stream(device=torch.device("cuda", index))
    return stream


class LoRAStep:
    """One step's token->slot mapping and device metadata, shared by every layer and projection."""

    def __init__(self, pool: SlotPool, token_slots: torch.Tensor, num_active: int, use_triton: bool,
                 fuse_silu_mul: bool = False, overlap_shrink: bool = False, expand_first_min_tokens: int = 0,
                 has_base_tokens: bool = True, gemm_shrink: bool = False, long_tokens: int | None = None,
                 max_adapters: int | None = None, gemm_slots: int | None = None, fold_shrink: bool = False) -> None:
        self.pool = pool
        self.token_slots = token_slots  # [T] int32
        self.num_active = num_active  # distinct adapters in the step (host-known)
        self.use_triton = use_triton
        self.fuse_silu_mul = fuse_silu_mul  # gate|up's delta added inside SiLU-and-multiply (silu_mul)
        self._meta = None
        self._scratch = None
        self._counters = None
        self._configs: dict[str, object] = {}
        self._chunk_ranks = None
        # the shrink of ``linear`` on a forked stream, alongside the base GEMM (Triton on CUDA only)
        self.overlap_shrink = bool(overlap_shrink and use_triton and num_active and token_slots.is_cuda)
        # steps of at least this many tokens (0: never) run the LoRA work before the base GEMM, which accumulates
        # into the expand's output (``_expand_first_linear``); rows without an adapter then need zeros (the expand's)
        self.expand_first = bool(use_triton and num_active
                                 and runs_expand_first(expand_first_min_tokens, token_slots.shape[0]))
        self.has_base_tokens = has_base_tokens  # host-known: False spares the expand zeroing base rows
        self.long_tokens = long_tokens  # host-known: tokens in requests of more than 32 (None: unknown)
        # the shrink inside the base GEMM for projections whose pool A rows are folded under the base weight
        # (``SlotPool.fold_base_weights``): one cuBLAS GEMM gives the base output and every slot's y, then the expand
        self.gemm_shrink = bool(gemm_shrink and num_active)
        # ... over the first gemm_slots slots (None: all): every token's slot must lie below it
        self.gemm_slots = pool.max_loras if gemm_slots is None else min(int(gemm_slots), pool.max_loras)
        if use_triton and num_active:
            from loraplex.kernels import lora_ops
            from loraplex.kernels.lora_expand import slice_col_align
            from loraplex.kernels.lora_meta import build_lora_meta
            from loraplex.kernels.lora_ops import lora_apply
            from loraplex.kernels.lora_shrink import pdl_supported

            self._lora_apply = lora_apply
            self._ops = lora_ops
            self._col_align = {p: min(16, slice_col_align(pool.slice_loc_host[p])) if lora_ops.VECTORIZE_EXPAND
                               else 1 for p in PROJ_MODULES}

            num_tokens = token_slots.shape[0]
            shapes = pool.shapes
            pdl = pdl_supported(token_slots.device)
            # long_tokens (host-known): tokens in requests of more than 32 in the step; most of them there gives
            # prefill tiles whatever the mean per adapter (choose_config)
            # max_adapters: a host-known bound on the step's distinct adapters that sizes the chunk tables and so
            # every grid (bench lora_plan; the engine passes none, smaller grids measured slower in run 28, except
            # for the in-GEMM shrink over the first W slots, whose steps carry at most W); None: the pool's slot
            # count. A step must never carry more.
            self._configs = step_configs(shapes, pool.max_loras, pool.max_rank, num_tokens, num_active, pdl,
                                         long_tokens, max_adapters)
            self._widths = {p: max(shapes.slice_widths(p)) for p in PROJ_MODULES}
            block_m = self._configs["qkv"].block_m  # same regime for every proj (depends on T and adapters)
            # one launch on CUDA for decode-sized steps (inside the decode CUDA graph: every launch counts)
            self._meta = build_lora_meta(token_slots, pool.max_loras, block_m, max_adapters=max_adapters)
            parts = max(c.parts_max for c in self._configs.values())
            self._scratch = torch.empty(parts, 3, num_tokens, pool.max_rank, dtype=torch.float32,
                                        device=token_slots.device)
            # rank of each chunk's slot, every layer and module ([L, 7, max_chunks]; 2 launches per step): a
            # kernel then reads slot, rank and tokens of its chunk in one round trip
            if any(c.chunk_tables for c in self._configs.values()):
                # rows padded to a multiple of 4 entries: every (layer, module) row starts 16-byte aligned, so
                # the kernels see one pointer alignment whatever the chunk count (one compiled variant)
                chunks = self._meta.max_chunks
                slots = torch.nn.functional.pad(self._meta.chunk_slots.clamp(min=0), (0, -chunks % 4))
                self._chunk_ranks = pool.ranks.index_select(2, slots)[:, :, :chunks]
            self._counters = None
            self.ensure_counters()
        self.fold_shrink = fold_shrink  # the down shrink inside SiLU-and-multiply where it can run (folds_down_shrink)
        self._pre_shrunk = None  # (layer, proj, y, valid) of a folded shrink, for the next ``linear`` of that proj

    def replace_configs(self, change) -> None:
        """Every projection's kernel configuration replaced by ``change(proj, config)`` (a dict of fields to change;
        the benchmarks' launch policies), the fp32 scratch grown if the new ones write more K parts, and the
        counters of one-launch kernels made if a new one needs them."""
        self._configs = {p: dataclasses.replace(c, **change(p, c)) for p, c in self._configs.items()}
        need = max(c.parts_max for c in self._configs.values())
        if need > self._scratch.shape[0]:
            self._scratch = torch.empty(need, *self._scratch.shape[1:], dtype=torch.float32,
                                        device=self._scratch.device)
        self.ensure_counters()

    def ensure_counters(self) -> None:
        """The counts of the one-launch kernels (the ticketed shrink + expand, the fused decode kernel's last-arriver
        expand), when a configuration of this step uses one: shared by every launch of the step, each launch leaving
        them at 0. Called again after a caller (the bench) overrides the configurations."""
        if self._counters is None and any(c.ticketed or (c.fused and c.fused_split_k > 1)
                                          for c in self._configs.values()):
            from loraplex.kernels.lora_ticketed import counters_size

            self._counters = torch.zeros(counters_size(self._meta.max_chunks, 3), dtype=torch.int32,
                                         device=self.token_slots.device)

    @property
    def has_adapters(self) -> bool:
        return self.num_active > 0

    @property
    def folds_down_shrink(self) -> bool:
        """Whether the model should call ``silu_mul_shrink`` for SiLU-and-multiply (then ``linear`` for down): asked
        for, and down would run the usual two launches (Triton, adapters in the step, gate|up's delta not inside
        SiLU, down neither fused, ticketed nor in-GEMM)."""
        return bool(self.fold_shrink and self.use_triton and self.num_active and not self.fuse_silu_mul
                    and not self._fused("down") and not self._configs["down"].ticketed
                    and not (self.gemm_shrink and "down" in self.pool.folded))

    def silu_mul_shrink(self, layer_idx: int, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` [T, I] of gate|up's output, in the launch that also runs the down projection's shrink
        on it (``lora_fold.silu_mul_shrink``); the next ``linear(layer_idx, "down", ...)`` runs the rest."""
        assert self.folds_down_shrink and self._pre_shrunk is None, "no folded shrink planned, or one not yet consumed"
        from loraplex.kernels.lora_ops import lora_silu_mul_shrink_apply

        if gate_up.stride(-1) != 1:
            gate_up = gate_up.contiguous()
        a, _, ranks = self.pool.layer_view("down", layer_idx)
        act, y, valid = lora_silu_mul_shrink_apply(gate_up, a, ranks, self._meta, self._configs["down"],
                                                   self._scratch, self._layer_chunk_ranks(layer_idx, "down"))
        self._pre_shrunk = (layer_idx, "down", y, valid)
        return act

    @property
    def fuses_silu_mul(self) -> bool:
        """Whether the model should call ``silu_mul`` with gate|up's base output instead of ``linear`` + SiLU."""
        return self.fuse_silu_mul and self.num_active > 0 and not (self.use_triton and self._configs["gate_up"].fused)

    def silu_mul(self, layer_idx: int, x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate + dg) * (up + du)`` [T, I] from gate|up's base output [T, 2I] (not modified) and its input x:
        the shrink, then ``lora_silu_mul`` (the expand folded into SiLU-and-multiply, no write of gate|up)."""
        a, bt, ranks = self.pool.layer_view("gate_up", layer_idx)
        if x.stride(-1) != 1:
            x = x.contiguous()
        if not self.use_triton:
            from loraplex.kernels.lora_ref import lora_shrink_ref
            from loraplex.kernels.lora_silu_mul import lora_silu_mul_ref

            y = lora_shrink_ref(x, a, self.token_slots, ranks)
            return lora_silu_mul_ref(gate_up, y, bt, self.token_slots, ranks, self.pool.scaling)
        from loraplex.kernels.lora_ops import lora_silu_mul_apply

        return lora_silu_mul_apply(x, gate_up, a, bt, ranks, self.pool.scaling, self._meta, self._configs["gate_up"],
                                   self._scratch, self._layer_chunk_ranks(layer_idx, "gate_up"))

    def _layer_chunk_ranks(self, layer_idx: int, proj: str) -> torch.Tensor | None:
        """[S, max_chunks] ranks of each chunk's slot for this layer and projection (None without the tables)."""
        if self._chunk_ranks is None:
            return None
        lo, hi = self.pool.module_range[proj]
        return self._chunk_ranks[layer_idx, lo:hi]

    def linear(self, layer_idx: int, proj: str, x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` plus every token's adapter delta for ``proj``: the base GEMM, then ``add``;
        with ``overlap_shrink``, the shrink on a forked stream while the GEMM runs, then the expand; after a folded
        shrink (``silu_mul_shrink``), the GEMM and the expand only."""
        if self._pre_shrunk is not None and self._pre_shrunk[:2] == (layer_idx, proj):
            return self._linear_pre_shrunk(layer_idx, proj, x, weight, bias)
        if self.gemm_shrink and bias is None and proj in self.pool.folded and not self._fused(proj):
            folded, n = self.pool.folded[proj]
            if weight.shape[0] == n and weight.data_ptr() == folded[layer_idx].data_ptr():
                return self._gemm_shrink_linear(layer_idx, proj, x, folded[layer_idx], n)
        if self.expand_first and bias is None and proj in self._configs and not self._configs[proj].fused:
            return self._expand_first_linear(layer_idx, proj, x, weight)
        if self.overlap_shrink and proj in self._configs and not self._configs[proj].fused:
            return self._overlapped_linear(layer_idx, proj, x, weight, bias)
        return self.add(layer_idx, proj, x, base_linear(x, weight, bias))

    def _linear_pre_shrunk(self, layer_idx: int, proj: str, x: torch.Tensor, weight: torch.Tensor,
                           bias: torch.Tensor | None) -> torch.Tensor:
        """The base GEMM and the expand of partials a folded shrink already wrote, in the step's order (the expand
        first, writing the output the GEMM accumulates into, with ``expand_first``)."""
        _, _, y, valid = self._pre_shrunk
        self._pre_shrunk = None
        _, bt, ranks = self.pool.layer_view(proj, layer_idx)
        cfg = self._configs[proj]
        chunk_ranks = self._layer_chunk_ranks(layer_idx, proj)
        if self.expand_first and bias is None:
            return self._expand_then_gemm(proj, y, valid, x, weight, bt, ranks, cfg, chunk_ranks)
        return self._expand(proj, y, valid, base_linear(x, weight, bias), bt, ranks, cfg, chunk_ranks)

    def _fused(self, proj: str) -> bool:
        return bool(self.use_triton and proj in self._configs and self._configs[proj].fused)

    def _gemm_shrink_linear(self, layer_idx: int, proj: str, x: torch.Tensor, folded: torch.Tensor,
                            n: int) -> torch.Tensor:
        """One GEMM over the folded weight ([W; A of every slot], ``SlotPool.fold_base_weights``) cut after the A
        rows of the first ``gemm_slots`` slots (a view: the rows are contiguous): its first n columns are the base
        output, the rest those slots' y for every token; then the expand reads each token's own slot's group of y
        and adds the delta into the base columns. Returns the base columns, a view with the GEMM's row stride. The
        GEMM reads the A of every slot below the cut, used or not: it pays when most of them are in the step, and
        it moves those bytes at cuBLAS's rate instead of the shrink kernel's, without the shrink's launch."""
        num_slices, max_rank = len(PROJ_MODULES[proj]), self.pool.max_rank
        full = torch.nn.functional.linear(x, folded[:n + self.gemm_slots * num_slices * max_rank])
        out = full[:, :n]
        _, bt, ranks = self.pool.layer_view(proj, layer_idx)
        if not self.use_triton:
            from loraplex.kernels.lora_ref import gemm_shrink_y, lora_expand_ref

            y = gemm_shrink_y(full, n, self.token_slots, num_slices, max_rank)
            return lora_expand_ref(y, bt, self.token_slots, ranks, self.pool.scaling,
                                   self.pool.slice_loc_host[proj], out)
        num_tokens = x.shape[0]
        y = full.as_strided((1, num_slices, num_tokens, max_rank), (0, max_rank, full.stride(0), 1),
                            full.storage_offset() + n)
        return self._ops.lora_expand_apply(y, {}, out, bt, ranks, self.pool.scaling, self.pool.slice_loc[proj],
                                           self._widths[proj], self._meta, self._configs[proj], self._col_align[proj],
                                           self._layer_chunk_ranks(layer_idx, proj),
                                           y_slot_stride=num_slices * max_rank)

    def _expand_first_linear(self, layer_idx: int, proj: str, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The LoRA work first, then the base GEMM accumulating into its result: the shrink, the expand *writing*
        ``out`` (the delta; zeros in slices an adapter does not target), then ``out += x @ W^T`` (cuBLAS with
        beta = 1, whose epilogue reads ``out``). The usual order (GEMM, then an expand that reads and rewrites
        ``out``) moves the projection's output through memory twice more; in a large step the GEMM is
        compute-bound and its epilogue's read is nearly free. Rows of tokens without an adapter start at zero:
        the expand's extra programs write them (``zero_base``) when the step may have some."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        a, bt, ranks = self.pool.layer_view(proj, layer_idx)
        cfg = self._configs[proj]
        chunk_ranks = self._layer_chunk_ranks(layer_idx, proj)
        y, valid = self._ops.lora_shrink_apply(x, a, ranks, self._meta, cfg, self._scratch, chunk_ranks)
        return self._expand_then_gemm(proj, y, valid, x, weight, bt, ranks, cfg, chunk_ranks)

    def _expand_then_gemm(self, proj: str, y, valid: dict, x: torch.Tensor, weight: torch.Tensor, bt, ranks, cfg,
                          chunk_ranks) -> torch.Tensor:
        """The write-only expand of the shrink's partials ``y`` into a new output (zeros in base rows where the step
        may have some), then the base GEMM accumulating into it."""
        out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
        self._expand(proj, y, valid, out, bt, ranks, cfg, chunk_ranks, accumulate=False,
                     zero_base=self.has_base_tokens)
        return base_linear(x, weight, out=out, accumulate=True)

    def _overlapped_linear(self, layer_idx: int, proj: str, x: torch.Tensor, weight: torch.Tensor,
                           bias: torch.Tensor | None) -> torch.Tensor:
        """Fork: the shrink (x -> the step's fp32 scratch) on the side stream; the GEMM on the current one; join;
        the expand into the GEMM's output. The fork waits for everything queued before it, so the previous
        projection's expand (the scratch's last reader) is done before this shrink writes it, and nothing queued
        after the join can reuse x's memory before the shrink has read it. Works under CUDA-graph capture (the
        fork and join become graph edges)."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        a, bt, ranks = self.pool.layer_view(proj, layer_idx)
        cfg = self._configs[proj]
        chunk_ranks = self._layer_chunk_ranks(layer_idx, proj)
        main = torch.cuda.current_stream(x.device)
        side = side_stream(x.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            y, valid = self._ops.lora_shrink_apply(x, a, ranks, self._meta, cfg, self._scratch, chunk_ranks, pdl=False)
        out = base_linear(x, weight, bias)
        main.wait_stream(side)
        return self._expand(proj, y, valid, out, bt, ranks, cfg, chunk_ranks)

    def _expand(self, proj: str, y, valid: dict, out: torch.Tensor, bt, ranks, cfg, chunk_ranks,
                accumulate: bool = True, zero_base: bool = False) -> torch.Tensor:
        """The expand of one layer's ``proj`` from a shrink's partials ``y`` into ``out`` (``lora_expand_apply``
        with this step's pool, metadata and column hints)."""
        return self._ops.lora_expand_apply(y, valid, out, bt, ranks, self.pool.scaling, self.pool.slice_loc[proj],
                                           self._widths[proj], self._meta, cfg, self._col_align[proj], chunk_ranks,
                                           accumulate=accumulate, zero_base=zero_base)

    def add(self, layer_idx: int, proj: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out [T, N_total] += LoRA delta of x [T, K] for ``proj`` in qkv | o | gate_up | down."""
        if not self.num_active:
            return out
        if proj not in PROJ_MODULES:
            raise ValueError(f"proj must be one of {', '.join(PROJ_MODULES)}, got {proj!r}")
        a, bt, ranks = self.pool.layer_view(proj, layer_idx)
        if x.stride(-1) != 1:
            x = x.contiguous()
        if self.use_triton:
            return self._lora_apply(x, out, a, bt, ranks, self.pool.scaling, self.pool.slice_loc[proj],
                                    self._widths[proj], self._meta, self._configs[proj], self._scratch,
                                    self._counters, self._col_align[proj], self._layer_chunk_ranks(layer_idx, proj))
        from loraplex.kernels.lora_ref import lora_apply_ref

        return lora_apply_ref(x, out, a, bt, self.token_slots, ranks, self.pool.scaling,
                              self.pool.slice_loc_host[proj])
