"""Turns one ``SchedulerOutput`` into tensors, runs the model over the paged KV cache, and samples.

Per step: the token ids, positions, slot mapping, block tables, query start offsets and sequence lengths
are built once on the host (vectorized, no per-token Python loop), moved to the device together, and read
by every layer; the only device-to-host copy is the sampled tokens (and logprobs when asked for).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import numpy as np
import torch

from loraplex.engine import parallel
from loraplex.engine.attention import AttentionMetadata, get_attention_backend
from loraplex.engine.config import EngineConfig
from loraplex.engine.cuda_graphs import DecodeGraphRunner
from loraplex.engine.kv_cache import LayerKV
from loraplex.engine.models.llama import LlamaConfig, LlamaForCausalLM
from loraplex.engine.piecewise_graphs import PiecewiseGraphRunner
from loraplex.engine.sampler import Sampler
from loraplex.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from loraplex.engine.step_inputs import StepBatch, StepInputBuilder
from loraplex.engine.step_sampler import PendingSample, StepSampler
from loraplex.engine.weights import load_weights
from loraplex.kernels.lora_ops import long_tokens_of

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, hf_config: dict, device: torch.device) -> torch.dtype:
    if name != "auto":
        if name not in _DTYPES:
            raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)} (got {name!r})")
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    return _DTYPES.get(hf_config.get("dtype") or hf_config.get("torch_dtype") or "bfloat16", torch.bfloat16)


class ModelRunner:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = torch.device(config.device)
        # the whole model's config; under tensor parallelism (engine/parallel.py) this rank runs its shard
        self.whole_hf_config = json.loads((Path(config.model) / "config.json").read_text())
        self.tp = parallel.current() if config.tensor_parallel_size > 1 else None
        if config.tensor_parallel_size > 1 and self.tp is None:
            raise RuntimeError("tensor_parallel_size > 1 needs the process group (LLMEngine starts it)")
        if self.tp is not None:  # KV-head replicas and the vocabulary-parallel head, from the whole model
            self.tp = parallel.with_layout(self.tp, self.whole_hf_config)
        self.hf_config = parallel.local_hf_config(self.whole_hf_config, config.tensor_parallel_size)
        self.model_config = LlamaConfig.from_hf(self.hf_config)
        self.dtype = resolve_dtype(config.dtype, self.hf_config, self.device)
        vocab_parts = self.tp.size if self.tp is not None and self.tp.vocab_parallel else 1
        self.model = LlamaForCausalLM(self.model_config, self.device, self.dtype,
                                      reduce=parallel.all_reduce_ if self.tp is not None else None,
                                      vocab_parts=vocab_parts, gather_vocab=parallel.all_gather_vocab)
        load_weights(self.model, config.model,
                     shard=(lambda name, t: parallel.shard_checkpoint_tensor(name, t, self.tp)) if self.tp else None)
        self.weight_bytes_freed = 0
        if config.quantization:
            from loraplex.engine.quant import quantize_model_

            self.weight_bytes_freed = quantize_model_(self.model, config.quantization)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()  # the KV cache is sized from free memory next
        self.backend = get_attention_backend(self.device)
        self.sampler = Sampler(self.device, config.seed)
        self.step_sampler = StepSampler(self.model.compute_logits, self.sampler, self.device,
                                        max_rows=config.max_num_seqs)
        pin = self.device.type == "cuda" and torch.cuda.is_available()
        self._fixup_host = torch.zeros(2, config.max_num_seqs, dtype=torch.int64, pin_memory=pin)
        self.kv_caches: list[LayerKV] = []
        self.lora_manager = None
        self.inputs: StepInputBuilder | None = None  # with the KV cache (needs the resolved limits)
        self.graphs: DecodeGraphRunner | None = None  # CUDA graphs of pure-decode steps (None: eager)
        # CUDA graphs of the other steps up to piecewise_graph_max_tokens tokens, captured around attention
        self.piecewise: PiecewiseGraphRunner | None = None

    def max_len_limit(self) -> int:
        """The longest sequence the model allows (its position embeddings, or its sliding window)."""
        mc = self.model_config
        return min(mc.max_position_embeddings, mc.sliding_window or mc.max_position_embeddings)

    def start_up(self) -> int:
        """After ``config.resolve``: the LoRA slot pool (before the KV cache takes "free" memory), the KV cache
        (under tensor parallelism the smallest size any rank can hold), the CUDA graphs and the eager warm-up.
        Every rank runs this same sequence (its collectives must match). Returns the number of KV blocks."""
        if self.config.enable_lora:
            self.get_lora_manager()
        num_blocks = self.plan_num_blocks()
        if self.tp is not None:
            num_blocks = parallel.agree_min(num_blocks)
        self.allocate_kv_cache(num_blocks)
        self.capture_cuda_graphs()  # CUDA only (and not with enforce_eager)
        started = time.perf_counter()
        try:
            runs = self.warmup_eager()
        except Exception as exc:  # noqa: BLE001 - an optimization: the first requests then pay the compiles
            if self.tp is not None:
                raise  # the other ranks ran their passes: going on would pair mismatched collectives
            log.warning("start-up warm-up of the eager path failed (%s); kernels compile on first use", exc)
            return num_blocks
        if runs:
            log.info("warmed up the eager path (%d forward passes) in %.1f s", runs, time.perf_counter() - started)
        return num_blocks

    def register_step_adapters(self, out: SchedulerOutput) -> None:
        """A tensor-parallel worker learns each adapter from the first step that uses it (rank 0's scheduler
        admitted it after its own read): read (and cut to this rank's shard) now, before the step needs its slot."""
        manager = self.get_lora_manager()
        seen: set[int] = set()
        for s in out.scheduled:
            lora = s.request.lora_request
            if lora is not None and lora.lora_int_id not in seen:
                seen.add(lora.lora_int_id)
                if not manager.is_ready(lora.lora_int_id):
                    manager.validate_and_prefetch(lora)

    # ---- KV cache ------------------------------------------------------------------------------
    @property
    def kv_dtype(self) -> torch.dtype:
        """The KV cache's element type (``EngineConfig.kv_cache_dtype``; "auto": the model's dtype)."""
        name = self.config.kv_cache_dtype
        if name == "int8":
            return torch.int8
        return torch.float8_e4m3fn if name in ("fp8", "fp8_e4m3") else self.dtype

    def bytes_per_block(self) -> int:
        """K and V of one block over all layers (and an INT8 cache's fp32 scale per token and KV head)."""
        mc = self.model_config
        elem = torch.empty((), dtype=self.kv_dtype).element_size()
        per_head = mc.head_dim * elem + (4 if self.kv_dtype == torch.int8 else 0)
        return 2 * mc.num_layers * self.config.block_size * mc.num_kv_heads * per_head

    def plan_num_blocks(self) -> int:
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        per_seq = -(-cfg.max_model_len // cfg.block_size)
        enough = cfg.max_num_seqs * per_seq + 1
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = free - (1 - cfg.gpu_memory_utilization) * total
        else:
            budget = cfg.kv_cache_memory_gb * (1 << 30)
        num = min(enough, int(budget // self.bytes_per_block()))
        if num < per_seq:
            raise ValueError(f"KV cache of {num} blocks cannot hold one sequence of max_model_len "
                             f"{cfg.max_model_len}; lower max_model_len or give the cache more memory")
        return num

    def allocate_kv_cache(self, num_blocks: int) -> None:
        mc = self.model_config
        shape = (num_blocks, self.config.block_size, mc.num_kv_heads, mc.head_dim)
        # Zeroed on CUDA: a kernel that masks the tail of a block still multiplies its values by 0, and
        # 0 * NaN garbage is NaN. The CPU reference slices exactly, so the host skips the memset and RSS.
        alloc = torch.zeros if self.device.type == "cuda" else torch.empty
        int8 = self.kv_dtype == torch.int8

        def layer() -> LayerKV:
            kv = [alloc(shape, device=self.device, dtype=self.kv_dtype) for _ in range(2)]
            if int8:  # one fp32 scale per (token, KV head) row; zeros (not garbage) under masked-out keys
                kv += [torch.zeros(shape[:3], device=self.device, dtype=torch.float32) for _ in range(2)]
            return LayerKV(*kv)

        self.kv_caches = [layer() for _ in range(mc.num_layers)]
        cfg = self.config
        self.inputs = StepInputBuilder(cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_model_len,
                                       cfg.block_size, self.device)
        if self.device.type == "cuda" and not cfg.enforce_eager:
            self.graphs = self.make_graph_runner(capture=True)
            if cfg.piecewise_cuda_graphs:
                self.piecewise = self.make_piecewise_runner(capture=True)

    def make_graph_runner(self, capture: bool) -> DecodeGraphRunner:
        """Decode-step graphs over this runner's model and cache; ``capture=False`` runs the same padded
        static-buffer path without graphs (the CPU tests use it)."""
        return DecodeGraphRunner(self.model, self.kv_caches, self.backend, self.config.max_num_seqs,
                                 self.inputs.max_blocks_per_seq, self.device, capture=capture)

    def make_piecewise_runner(self, capture: bool) -> PiecewiseGraphRunner:
        """Piecewise graphs of the steps that are not pure decode, up to ``piecewise_graph_max_tokens`` tokens;
        ``capture=False`` runs the same pieces without graphs (the CPU tests use it)."""
        cfg = self.config
        max_tokens = max(1, min(cfg.max_num_batched_tokens, cfg.piecewise_graph_max_tokens))
        return PiecewiseGraphRunner(self.model, self.kv_caches, self.backend, max_tokens, self.device, capture=capture)

    def capture_cuda_graphs(self) -> None:
        """Capture the decode graphs of every batch bucket and the piecewise graphs of every token bucket now
        (start-up), with adapters too when LoRA is enabled, so that no serving step pays for a capture."""
        manager = self.get_lora_manager() if self.config.enable_lora and self.graphs is not None else None
        if self.graphs is not None:
            started = time.perf_counter()
            with torch.inference_mode():
                self.graphs.capture_all(manager)
            log.info("captured %d decode CUDA graphs (batch buckets %s) in %.1f s", self.graphs.num_graphs,
                     ",".join(map(str, self.graphs.buckets)), time.perf_counter() - started)
        if self.piecewise is not None:
            started = time.perf_counter()
            try:
                with torch.inference_mode():
                    self.piecewise.capture_all(manager)
            except Exception:  # a failed capture costs those steps their graphs, not the engine
                log.exception("capturing the piecewise CUDA graphs failed: prefill and mixed steps run eagerly")
                self.piecewise = None
                torch.cuda.synchronize(self.device)
                return
            log.info("captured %d piecewise CUDA graphs (%d pieces; token buckets %s) in %.1f s",
                     self.piecewise.num_graphs, self.piecewise.num_pieces, ",".join(map(str, self.piecewise.buckets)),
                     time.perf_counter() - started)

    @torch.inference_mode()
    def warmup_eager(self, force: bool = False) -> int:
        """Run the eager (prefill and mixed-step) forward at start-up on dummy inputs, so that Triton compiles
        its kernels now and not inside the first requests: base only at a full token budget and one token less
        (Triton specializes integer arguments divisible by 16), then one pass per set of LoRA kernel variants an
        eager step can run (``LoRAManager.warmup_steps``: tile regime and K parts by token and adapter count,
        expand-first with and without base tokens, the fused SiLU). Every row has slot -1 (no KV write, no
        adapter), so the cache and the slot pool are untouched. CUDA only unless ``force``; returns the number of
        forward passes run."""
        if self.device.type != "cuda" and not force:
            return 0
        cfg = self.config
        total = max(2, min(cfg.max_num_batched_tokens, cfg.max_model_len))
        passes: list[tuple[int, tuple | None]] = [(total, None), (total - 1, None)]
        if cfg.enable_lora:
            manager = self.get_lora_manager()
            cases = manager.warmup_steps(total)
            if not cases:  # the CPU twins (forced): one adapter and max_loras adapters, as a step would plan them
                cases = [(n, a, True, None) for n in (total, total - 1) for a in sorted({1, cfg.max_loras})]
            passes += [(num_tokens, tuple(case)) for num_tokens, *case in cases]
        for num_tokens, case in passes:
            self._warmup_forward(num_tokens, case)
        self._warmup_decode_splits()
        if cfg.enable_lora and self.get_lora_manager().use_triton:
            self._warmup_lora_meta(total)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return len(passes)

    def _warmup_forward(self, num_tokens: int, lora_case: tuple | None) -> None:
        """One eager forward of ``num_tokens`` dummy tokens as one sequence, every row with slot -1; ``lora_case``
        (distinct adapters, has_base_tokens, long_tokens) plans the step's LoRA kernels as for that many adapters
        (None: base only). The rows carry no adapter, so nothing is added."""
        dev, width = self.device, self.inputs.max_blocks_per_seq
        attn = AttentionMetadata(
            backend=self.backend, slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=dev),
            block_tables=torch.zeros(1, width, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=dev),
            seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=dev),
            max_query_len=num_tokens, max_seq_len=num_tokens)
        lora = None
        if lora_case is not None:
            num_adapters, has_base, long_tokens = lora_case
            slots = torch.full((num_tokens,), -1, dtype=torch.int32, device=dev)
            lora = self.get_lora_manager().make_step(slots, num_adapters, has_base_tokens=has_base,
                                                     long_tokens=long_tokens)
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=dev)
        hidden = self.model(ids, torch.arange(num_tokens, device=dev), self.kv_caches, attn, lora)
        self.model.compute_logits(hidden[-1:])

    def _warmup_decode_splits(self) -> int:
        """The split-KV decode kernel is compiled per split count (a constexpr). The decode graphs compile their
        buckets' counts, sized for long contexts; an eager step (a mixed step's decode rows, a decode step off the
        graphs) sizes them for its longest sequence, e.g. 2 splits for 32 decodes of 300 keys. Run layer 0's
        attention once for every count an eager step can pick (``num_splits_cases``), on zero queries that read
        block 0 and write nothing. Returns the number of calls."""
        from loraplex.kernels.attn_decode import num_splits_cases

        if not self.kv_caches:
            return 0
        cfg, dev = self.config, self.device
        layer = self.model.layers[0]
        kv = self.kv_caches[0]
        cases = num_splits_cases(cfg.max_num_seqs, kv.key.shape[2], cfg.max_model_len, dev)
        width = self.inputs.max_blocks_per_seq
        for batch, max_seq_len in cases.values():
            attn = AttentionMetadata(
                backend=self.backend, slot_mapping=torch.full((batch,), -1, dtype=torch.int64, device=dev),
                block_tables=torch.zeros(batch, width, dtype=torch.int32, device=dev),
                query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=dev),
                seq_lens=torch.ones(batch, dtype=torch.int32, device=dev), max_query_len=1, max_seq_len=max_seq_len)
            query = torch.zeros(batch, layer.num_heads, layer.head_dim, dtype=self.dtype, device=dev)
            self.backend.attention(query, kv, attn, layer.scale)
        return len(cases)

    def _warmup_lora_meta(self, total: int) -> None:
        """The single-launch LoRA metadata builder is compiled per power of two of the step's token count (its
        tile sizes): build it once for each size an eager step can have, for both chunk sizes (decode- and
        prefill-like steps), so that no serving step compiles one."""
        from loraplex.kernels.lora_meta import META_KERNEL_MAX_TOKENS, build_lora_meta

        num_slots, size = self.config.max_loras, 16
        while size // 2 < min(META_KERNEL_MAX_TOKENS, total):
            for num_tokens in {min(size, total), size // 2 + 1}:
                slots = torch.full((num_tokens,), -1, dtype=torch.int32, device=self.device)
                for block_m in (16, 64):
                    build_lora_meta(slots, num_slots, block_m)
            size *= 2

    # ---- LoRA ----------------------------------------------------------------------------------
    def get_lora_manager(self):
        if self.lora_manager is None:
            if not self.config.enable_lora:
                raise ValueError("this engine was started without enable_lora; adapters cannot be used")
            try:
                from loraplex.adapters.manager import LoRAManager
            except ImportError as exc:
                raise RuntimeError("LoRA support (loraplex.adapters.manager) is not available") from exc
            self.lora_manager = LoRAManager(
                self.hf_config, max_loras=self.config.max_loras, max_lora_rank=self.config.max_lora_rank,
                max_cpu_loras=self.config.max_cpu_loras, device=self.device, dtype=self.dtype,
                num_load_workers=self.config.lora_load_workers,
                tp=(self.tp, self.whole_hf_config) if self.tp is not None else None)
            self.lora_manager.fuse_silu_mul = self.config.fuse_lora_silu_mul
            self.lora_manager.silu_mul_min_tokens = self.config.lora_silu_mul_min_tokens
            self.lora_manager.overlap_shrink = self.config.lora_overlap_shrink
            self.lora_manager.expand_first_min_tokens = self.config.lora_expand_first_min_tokens
            self.lora_manager.segment_tiles = self.config.lora_segment_tiles
            self.lora_manager.fold_shrink_max_tokens = self.config.lora_fold_shrink_max_tokens
            if self.config.lora_gemm_shrink:
                self._fold_lora_rows()
            if self.config.merge_single_lora:
                from loraplex.adapters.merged import MergedLoRA

                self.lora_manager.merged = MergedLoRA(self.model, self.lora_manager.pool)
        return self.lora_manager

    def _fold_lora_rows(self) -> None:
        """Engine option ``lora_gemm_shrink``: every projection's base weight and the slot pool's A rows into one
        tensor per projection (``SlotPool.fold_base_weights``), the model's weights then views of it. Skipped (with
        a log line) where the in-GEMM shrink cannot run: tensor parallelism (the row-parallel outputs are
        all-reduced in place), 8-bit weights, a projection with a bias, no GEMM width a decode step could use
        (``LoRAManager.gemm_shrink_widths``). On the CPU the twins run the same order."""
        from loraplex.adapters.manager import gemm_shrink_widths

        manager, model = self.lora_manager, self.model
        most = min(self.config.lora_gemm_shrink_max_tokens, self.config.max_num_seqs)
        usable = any(gemm_shrink_widths(manager.max_loras, t) for t in range(1, most + 1))
        why = ("tensor parallelism" if self.tp is not None else "8-bit weights" if self.config.quantization
               else f"no GEMM width a decode step of at most {most} tokens could fill half of (max_loras "
                    f"{manager.max_loras})" if not usable else None)
        if why is not None:
            log.info("lora_gemm_shrink: ignored (%s)", why)
            return
        folded = []
        for proj in ("qkv", "o", "gate_up", "down"):
            if any(getattr(layer, f"{proj}_bias") is not None for layer in model.layers):
                continue
            weights = [getattr(layer, f"{proj}_weight") for layer in model.layers]
            if self._stage_before_fold(proj, weights):
                # not enough free memory for the folded tensor beside the weights: they wait in host memory
                weights = [w.detach().cpu() for w in weights]
                for layer, w in zip(model.layers, weights):
                    setattr(layer, f"{proj}_weight", torch.nn.Parameter(w, requires_grad=False))
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
            views = manager.pool.fold_base_weights(proj, weights)
            for layer, view in zip(model.layers, views):
                setattr(layer, f"{proj}_weight", torch.nn.Parameter(view, requires_grad=False))
            folded.append(proj)
        manager.gemm_shrink_max_tokens = self.config.lora_gemm_shrink_max_tokens if folded else 0
        manager.gemm_shrink_max_moves = self.config.lora_gemm_shrink_max_moves if folded else 0
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the KV cache is sized from free memory next
        log.info("lora_gemm_shrink: %s folded with the A rows of %d slots (decode steps up to %d tokens)",
                 ", ".join(folded) or "no projection", manager.max_loras, self.config.lora_gemm_shrink_max_tokens)

    def _stage_before_fold(self, proj: str, weights: list[torch.Tensor]) -> bool:
        """Whether folding ``proj`` must first move its base weights to host memory: the folded tensor (weights and
        every slot's A rows) is allocated while the weights still exist, so on CUDA it needs their size plus the A
        rows free, with 1 GiB to spare."""
        if self.device.type != "cuda":
            return False
        pool = self.lora_manager.pool
        need = sum(w.numel() for w in weights) * weights[0].element_size() + pool.a[proj].numel() * pool.a[
            proj].element_size()
        free, _ = torch.cuda.mem_get_info(self.device)
        stage = free < need + (1 << 30)
        if stage:
            log.info("lora_gemm_shrink: %s staged in host memory while folding (%.1f GiB free, %.1f GiB needed)",
                     proj, free / 2**30, need / 2**30)
        return stage

    # ---- one step ------------------------------------------------------------------------------
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and wait for its results."""
        return self.launch(out).result()

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput, prev: PendingSample | None = None) -> PendingSample:
        """Queue one step on the device; ``result()`` of the returned object waits for its tokens.

        Input tokens that are still placeholders (``PLACEHOLDER_TOKEN``: the previous step's samples, which
        the host does not have yet) are read on the device from ``prev.tokens``."""
        if out.blocks_to_copy:
            src, dst = (torch.tensor(x, device=self.device) for x in zip(*out.blocks_to_copy))
            for kv in self.kv_caches:
                for cache in kv.tensors():  # K, V (and an INT8 cache's scales)
                    if cache.dtype == torch.float8_e4m3fn:  # copy the bytes (no float8 index_put everywhere)
                        cache = cache.view(torch.uint8)
                    cache[dst] = cache[src]
        if out.is_empty:
            return PendingSample(ModelRunnerOutput())
        graphs = self.graphs
        batch = self.inputs.prepare(out, graphs.bucket_for if graphs is not None else None)
        fixup, inflight = self._placeholder_fixup(out, batch, prev)
        if batch.graph_bucket is not None:
            slot_of = (self.get_lora_manager().assign_slots(out.lora_ids, decode_tokens=batch.graph_bucket)
                       if out.lora_ids else None)
            if self._merged_step(slot_of, batch):
                slot_of = None  # one adapter folded into the weights: the base graph
            # the next step's prepare() waits for these input copies only, not for this step's replay: an
            # event after the replay made the host wait for the whole step before building the next one,
            # so the GPU idled while the host prepared and launched it
            hidden = graphs.run(batch, self.lora_manager, slot_of, fixup=fixup, inputs_queued=self.inputs.mark_copied)
        elif self.piecewise is not None and self.piecewise.bucket_for(batch.num_tokens) is not None:
            hidden = self._run_piecewise(out, batch, fixup)
        else:
            hidden = self._run_eager(out, batch, fixup)
        return self.step_sampler.launch(out, batch, hidden, inflight)

    def _merged_step(self, slot_of: dict[int, int] | None, batch: StepBatch) -> bool:
        """Whether the step runs on merged weights (``merge_single_lora``); restores them first when it cannot."""
        merged = self.lora_manager.merged if self.lora_manager is not None else None
        if merged is None:
            return False
        return merged.step(slot_of, batch.lora_ids is None or 0 in batch.lora_ids, batch.num_tokens)

    def _placeholder_fixup(self, out: SchedulerOutput, batch: StepBatch, prev: PendingSample | None):
        """(None, None), or a function that writes the previous step's device tokens into this step's input
        ids at the rows that hold a placeholder (a sequence's single new token, sampled by ``prev``) and the
        sampler's in-flight map (seq_id -> index into ``prev.tokens``, with that tensor)."""
        ids = batch.input_ids.numpy()[:batch.num_tokens]
        rows = np.flatnonzero(ids < 0)
        if not rows.size:
            return None, None
        assert prev is not None and prev.is_async, "placeholder input without the step that samples it"
        # a placeholder is its sequence's only new token, so its row is that sequence's last row
        seq_of_row = np.searchsorted(batch.last_token_rows, rows)
        scheduled = out.scheduled
        seq_ids = [scheduled[i].request.seq_id for i in seq_of_row.tolist()]
        src = [prev.row_of[q] for q in seq_ids]
        n = rows.size
        staging = self._fixup_host[:, :n]  # reused each step: prepare() waited for the last step's copies
        staging[0] = torch.from_numpy(rows)
        staging[1] = torch.tensor(src, dtype=torch.int64)
        index = staging.to(self.device, non_blocking=True)
        tokens = prev.tokens

        def apply(input_ids: torch.Tensor) -> None:
            input_ids.index_copy_(0, index[0], tokens.index_select(0, index[1]))

        return apply, (dict(zip(seq_ids, src)), tokens)

    def _attention_metadata(self, batch: StepBatch) -> AttentionMetadata:
        dev = self.device
        nb = dev.type == "cuda"
        d = batch.num_decodes if self.config.attention_decode_split else 0
        query_start_loc = batch.query_start_loc.to(dev, non_blocking=nb)
        block_tables = batch.block_tables.to(dev, non_blocking=nb)
        seq_lens = batch.seq_lens.to(dev, non_blocking=nb)
        rest = rest_seq_lens = rest_block_tables = None
        if 0 < d < batch.seq_lens.shape[0]:
            # the varlen part's inputs, once per step rather than once per layer; its lengths and block rows as
            # tensors of their own, not slices that start d rows in (d % 4 != 0: another kernel variant, compiled
            # inside a serving step)
            rest = query_start_loc[d:] - d
            rest_seq_lens, rest_block_tables = seq_lens[d:].clone(), block_tables[d:].clone()
        return AttentionMetadata(
            backend=self.backend, slot_mapping=batch.slot_mapping.to(dev, non_blocking=nb),
            block_tables=block_tables, query_start_loc=query_start_loc, seq_lens=seq_lens,
            max_query_len=batch.max_query_len, max_seq_len=batch.max_seq_len, num_decodes=d,
            rest_query_start_loc=rest, rest_seq_lens=rest_seq_lens, rest_block_tables=rest_block_tables)

    def _run_piecewise(self, out: SchedulerOutput, batch: StepBatch, fixup=None) -> torch.Tensor:
        attn = self._attention_metadata(batch)
        slot_of = self.get_lora_manager().assign_slots(sorted(out.lora_ids)) if out.lora_ids else None
        if self._merged_step(slot_of, batch):
            slot_of = None  # one adapter folded into the weights: the base pieces
        return self.piecewise.run(batch, attn, self.lora_manager, slot_of, fixup=fixup,
                                  inputs_queued=self.inputs.mark_copied)

    def _run_eager(self, out: SchedulerOutput, batch: StepBatch, fixup=None) -> torch.Tensor:
        dev = self.device
        nb = dev.type == "cuda"
        attn = self._attention_metadata(batch)
        input_ids = batch.input_ids.to(dev, non_blocking=nb)
        positions = batch.positions.to(dev, non_blocking=nb)
        if fixup is not None:
            if not nb:
                input_ids = input_ids.clone()  # .to() on the CPU returned the host buffer itself
            fixup(input_ids)
        lora = None
        if out.lora_ids:
            # the step's adapter set is known on the host: no device sync to find it
            manager = self.get_lora_manager()
            slot_of = manager.assign_slots(sorted(out.lora_ids),
                                           decode_tokens=batch.num_tokens if batch.is_decode else None)
            if not self._merged_step(slot_of, batch):
                # some sequence without an adapter (its rows must start at zero in the write-first order)
                has_base = 0 in batch.lora_ids
                long_tokens = None if batch.is_decode else long_tokens_of(batch.query_lens)
                lora = manager.prepare_step(batch.token_lora_ids().to(dev, non_blocking=nb), slot_of=slot_of,
                                            has_base_tokens=has_base, pure_decode=batch.is_decode,
                                            long_tokens=long_tokens)
        else:
            self._merged_step(None, batch)
        self.inputs.mark_copied()  # after the last copy out of the builder's buffers
        return self.model(input_ids, positions, self.kv_caches, attn, lora)
