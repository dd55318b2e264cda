"""Turns one ``SchedulerOutput`` into tensors, runs the model over the paged KV cache, and samples.

Per step: the token ids, positions, slot mapping, block tables, query start offsets and sequence lengths
are built once on the host (vectorized, no per-token Python loop), moved to the device together, and read
by every layer; the only device-to-host copy is the sampled tokens (and logprobs when asked for).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from loraplex.engine.attention import AttentionMetadata, get_attention_backend
from loraplex.engine.config import EngineConfig
from loraplex.engine.models.llama import LlamaConfig, LlamaForCausalLM
from loraplex.engine.request import TokenLogprobs
from loraplex.engine.sampler import Sampler, SampleRow
from loraplex.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from loraplex.engine.weights import load_weights

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
        self.hf_config = json.loads((Path(config.model) / "config.json").read_text())
        self.model_config = LlamaConfig.from_hf(self.hf_config)
        self.dtype = resolve_dtype(config.dtype, self.hf_config, self.device)
        self.model = LlamaForCausalLM(self.model_config, self.device, self.dtype)
        load_weights(self.model, config.model)
        self.backend = get_attention_backend(self.device)
        self.sampler = Sampler(self.device, config.seed)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.lora_manager = None

    # ---- KV cache ------------------------------------------------------------------------------
    def bytes_per_block(self) -> int:
        mc = self.model_config
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * mc.num_layers * self.config.block_size * mc.num_kv_heads * mc.head_dim * elem

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
        self.kv_caches = [(alloc(shape, device=self.device, dtype=self.dtype),
                           alloc(shape, device=self.device, dtype=self.dtype)) for _ in range(mc.num_layers)]

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
                max_cpu_loras=self.config.max_cpu_loras, device=self.device, dtype=self.dtype)
        return self.lora_manager

    # ---- one step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        if out.blocks_to_copy:
            src, dst = (torch.tensor(x, device=self.device) for x in zip(*out.blocks_to_copy))
            for key_cache, value_cache in self.kv_caches:
                key_cache[dst] = key_cache[src]
                value_cache[dst] = value_cache[src]
        if out.is_empty:
            return ModelRunnerOutput()
        input_ids, positions, attn, token_lora_ids = self._prepare(out)
        lora = None
        if token_lora_ids is not None:
            # the step's adapter set is known on the host: no device sync to find it
            lora = self.get_lora_manager().prepare_step(token_lora_ids, adapter_ids=sorted(out.lora_ids))
        hidden = self.model(input_ids, positions, self.kv_caches, attn, lora)
        return self._sample(out, hidden)

    def _prepare(self, out: SchedulerOutput):
        bs = self.config.block_size
        token_ids: list[int] = []
        num_computed, num_new, tables, lora_ids = [], [], [], []
        for s in out.scheduled:
            req = s.request
            start = req.num_computed_tokens
            token_ids.extend(req.token_ids[start:start + s.num_new_tokens])
            num_computed.append(start)
            num_new.append(s.num_new_tokens)
            tables.append(req.block_ids)
            lora_ids.append(req.lora_id)
        width = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        q_lens = torch.tensor(num_new)
        ctx = torch.tensor(num_computed)
        query_start_loc = torch.zeros(len(num_new) + 1, dtype=torch.int32)
        torch.cumsum(q_lens, 0, out=query_start_loc[1:])
        seq_idx = torch.repeat_interleave(torch.arange(len(num_new)), q_lens)
        positions = torch.arange(len(token_ids)) - (query_start_loc[:-1].long() - ctx)[seq_idx]
        slot_mapping = block_tables[seq_idx, positions // bs].long() * bs + positions % bs
        dev = self.device
        attn = AttentionMetadata(
            backend=self.backend, slot_mapping=slot_mapping.to(dev, non_blocking=True),
            block_tables=block_tables.to(dev, non_blocking=True),
            query_start_loc=query_start_loc.to(dev, non_blocking=True),
            seq_lens=(ctx + q_lens).to(torch.int32).to(dev, non_blocking=True),
            max_query_len=max(num_new), max_seq_len=max(c + n for c, n in zip(num_computed, num_new)),
        )
        input_ids = torch.tensor(token_ids, dtype=torch.long).to(dev, non_blocking=True)
        token_lora_ids = None  # [T] int64: each token's adapter id (0 = base), only when a step has adapters
        if out.lora_ids:
            token_lora_ids = torch.repeat_interleave(torch.tensor(lora_ids), q_lens).to(dev, non_blocking=True)
        return input_ids, positions.to(dev, non_blocking=True), attn, token_lora_ids

    def _sample(self, out: SchedulerOutput, hidden: torch.Tensor) -> ModelRunnerOutput:
        result = ModelRunnerOutput()
        row_idx: list[int] = []  # hidden rows to sample from (repeated n times for a fork)
        rows: list[SampleRow] = []
        prompt_rows: list[tuple[int, list[int], list[int]]] = []  # (seq_id, hidden rows, target ids)
        offset = 0
        for s in out.scheduled:
            req = s.request
            last = offset + s.num_new_tokens - 1
            for k in range(s.num_samples):
                row_idx.append(last)
                rows.append(SampleRow(req.sampling_params, req.index + k, req.num_output_tokens,
                                      req.prompt_token_ids, req.output_token_ids))
            if s.wants_prompt_logprobs:
                done = max(len(req.prompt_logprobs) - 1, 0)
                first = max(req.num_computed_tokens, done)
                end = min(req.num_computed_tokens + s.num_new_tokens, req.num_prompt_tokens - 1)
                if end > first:
                    base = offset - req.num_computed_tokens
                    prompt_rows.append((req.seq_id, list(range(base + first, base + end)),
                                        req.token_ids[first + 1:end + 1]))
            offset += s.num_new_tokens
        num_sample_rows = len(row_idx)
        all_rows = row_idx + [r for _, rr, _ in prompt_rows for r in rr]
        if not all_rows:
            return result
        logits = self.model.compute_logits(hidden[torch.tensor(all_rows, device=self.device)])
        if num_sample_rows:
            self._collect_samples(out, logits[:num_sample_rows], rows, result)
        if prompt_rows:
            self._collect_prompt_logprobs(out, logits[num_sample_rows:], prompt_rows, result)
        return result

    def _collect_samples(self, out, logits, rows, result: ModelRunnerOutput) -> None:
        sampled = self.sampler(logits, rows)
        # one device->host copy for the tokens and their logprobs (float64 holds any token id exactly)
        packed = torch.stack((sampled.token_ids.double(), sampled.logprobs.double())).cpu()
        token_ids = [int(t) for t in packed[0].tolist()]
        lps = packed[1].tolist()
        ranks = sampled.ranks.tolist() if sampled.ranks is not None else None
        top_ids = sampled.top_ids.tolist() if sampled.top_ids is not None else None
        top_lps = sampled.top_logprobs.tolist() if sampled.top_logprobs is not None else None
        i = 0
        for s in out.scheduled:
            if not s.num_samples:
                continue
            seq_id, j = s.request.seq_id, i + s.num_samples
            result.sampled_token_ids[seq_id] = token_ids[i:j]
            result.sampled_logprobs[seq_id] = lps[i:j]
            num_top = s.request.sampling_params.logprobs
            if num_top is not None:
                result.logprobs[seq_id] = [
                    TokenLogprobs(token_ids[r], lps[r], ranks[r], top_ids[r][:num_top] if num_top else [],
                                  top_lps[r][:num_top] if num_top else [])
                    for r in range(i, j)]
            i = j

    def _collect_prompt_logprobs(self, out, logits, prompt_rows, result: ModelRunnerOutput) -> None:
        logprobs = torch.log_softmax(logits, dim=-1)
        targets = torch.tensor([t for _, _, tt in prompt_rows for t in tt], device=self.device)
        chosen = logprobs.gather(1, targets[:, None]).squeeze(1)
        ranks = ((logprobs > chosen[:, None]).sum(dim=-1) + 1).tolist()
        num_top = {s.request.seq_id: s.request.sampling_params.prompt_logprobs for s in out.scheduled}
        width = max(num_top[seq_id] for seq_id, _, _ in prompt_rows)
        top_lps, top_ids = logprobs.topk(width, dim=-1) if width else (logprobs[:, :0], logprobs[:, :0].long())
        chosen, top_lps, top_ids, tgt = chosen.tolist(), top_lps.tolist(), top_ids.tolist(), targets.tolist()
        r = 0
        for seq_id, hidden_rows, _ in prompt_rows:
            n = num_top[seq_id]
            result.prompt_logprobs[seq_id] = [
                TokenLogprobs(tgt[k], chosen[k], ranks[k], top_ids[k][:n], top_lps[k][:n])
                for k in range(r, r + len(hidden_rows))]
            r += len(hidden_rows)
