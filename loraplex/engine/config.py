"""One engine configuration object (pure Python): what the scheduler, block manager and runner read."""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "int8")
DTYPES = ("auto", "float32", "bfloat16", "float16")
# vLLM's other spellings of the same dtypes (its LLM(dtype=...) also takes a torch.dtype)
_DTYPE_ALIASES = {"half": "float16", "float": "float32"}


def served_model_id(model: str) -> str:
    """A base model directory's public id (``/v1/models``, the ``model`` requests name): the name of the directory
    it resolves to, so ``.``, a trailing slash or a symlink give the real directory's name."""
    return Path(model).resolve().name


def _dtype_name(dtype) -> str:
    """One of DTYPES for a name, a vLLM alias or a torch dtype; ValueError naming the field otherwise."""
    name = str(dtype).removeprefix("torch.") if type(dtype).__name__ == "dtype" else dtype
    name = _DTYPE_ALIASES.get(name, name) if isinstance(name, str) else name
    if name not in DTYPES or not isinstance(name, str):
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)} (or vLLM's 'half' and 'float', or a torch dtype "
                         f"of those), got {dtype!r}")
    return name


# a field's annotation (its first type; "| None" allows None) -> (accepted types, what the error calls it)
_FIELD_TYPES = {"int": (numbers.Integral, "an integer"), "float": (numbers.Real, "a number"),
                "bool": (bool, "true or false"), "str": (str, "a string")}


def _check_field_types(config: EngineConfig) -> None:
    """Each field of its annotated type (integers as ints); a ValueError naming the field otherwise: a float, None or
    string where a count belongs failed deep inside the engine's start-up, or was taken."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        kinds = f.type.split(" | ")
        if value is None and "None" in kinds:
            continue
        types, what = _FIELD_TYPES[kinds[0]]
        if not isinstance(value, types) or (kinds[0] != "bool" and isinstance(value, bool)):
            raise ValueError(f"{f.name} must be {what}{' or None' if 'None' in kinds else ''}, got {value!r}")
        if kinds[0] == "int":
            setattr(config, f.name, int(value))  # a numpy integer, as a plain int


@dataclass
class EngineConfig:
    model: str = ""  # Hugging Face directory (config.json + *.safetensors + tokenizer)
    tokenizer: str | None = None  # default: the model directory
    device: str = "cpu"  # "cpu" | "cuda" | "cuda:N"
    dtype: str = "auto"  # DTYPES ("auto": the config's dtype; float32 on the CPU); vLLM's "half", "float" or a torch dtype too
    seed: int | None = 0  # seeds sampling for requests without their own seed; None (vLLM's): one drawn at random
    # KV cache
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: sized from memory (kv_cache_memory_gb on the CPU, free HBM on CUDA)
    kv_cache_memory_gb: float = 1.0  # CPU only
    gpu_memory_utilization: float = 0.85  # CUDA only: fraction of total memory the engine may hold
    enable_prefix_caching: bool = True
    # "auto": the model's dtype; "fp8" (= "fp8_e4m3"): float8 e4m3 with a per-tensor scale of 1 (values saturate at
    # +-448), half the bytes per token, so about twice the blocks in the same memory and half the KV bytes each
    # decode step reads. The attention kernels convert the tiles to the query's dtype after their loads.
    # "int8": each (token, KV head) row as int8 with its own fp32 scale (max|x| / 127): 1 + 4/head_dim bytes per
    # value, no calibration, and a smaller error than fp8's 3-bit mantissa
    kv_cache_dtype: str = "auto"
    enforce_eager: bool = False  # CUDA only: no CUDA graphs (pure-decode steps replay one per batch bucket)
    # scheduling
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # token budget per step; default max(2048, max_model_len)
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    async_scheduling: bool | None = None  # overlap host work with the device's step; None: on for CUDA
    # torch intra-op threads of AsyncEngine's loop thread (the server's engine); 0 leaves torch's default; None: 1 when
    # the engine runs on the CPU (on a 2-core CPU the engine ran 3-5x faster in that thread with 1 than with torch's
    # 2: docs/benchmarks/engine-thread-cpu.md), torch's default on CUDA (the H200 showed no clear difference: run 10)
    loop_torch_threads: int | None = None
    lora_max_wait_steps: int = 16  # a request kept out by the max_loras limit this long stops other admissions
    # adapter grouping, while GPU slots cannot run out (max_loras >= max_num_seqs): within a priority, waiting
    # requests whose adapter already runs are admitted before the others, which follow grouped by adapter (every
    # distinct adapter in a step costs the step its weights' bytes); a request passed over lora_group_max_skips
    # admission rounds keeps its FCFS place again. Off by default: on the H200 it cut adapters per decode step
    # (zipf 46 -> 30, uniform 31 -> 8.4) for +1.7% offline throughput (run 14; run 9 showed none), and it favours
    # tenants whose adapters already run, against per-tenant fairness (docs/benchmarks/H200-2026-12-02-run14.md)
    lora_grouping: bool = False
    lora_group_max_skips: int = 64
    # prefill batching (as TGI's max-waiting-tokens): while sequences decode, new prompts wait until at least this
    # many prompt tokens wait, or the oldest has been held prefill_batch_max_wait_steps steps, and then go in
    # together: fewer steps carry prompt tokens (such steps run without the decode CUDA graphs). 0 = off (admit
    # every step); a waiting request that outranks a running one is never held
    prefill_batch_min_tokens: int = 0
    prefill_batch_max_wait_steps: int = 8
    # ... only while at least this many sequences run: at low load a held prompt waits for nothing
    prefill_batch_min_running: int = 32
    # LoRA
    enable_lora: bool = False
    max_loras: int = 8  # distinct adapters in one step (GPU slots)
    max_lora_rank: int = 64
    max_cpu_loras: int | None = None  # host cache size; default managed by the LoRA manager
    lora_load_workers: int | None = None  # background adapter read threads; None: min(4, CPUs)
    # while every token of every step uses one adapter, fold it into the base weights and run the base model
    # (adapters/merged.py); keeps a pristine copy of the projection weights on the device (about the model's size)
    merge_single_lora: bool = False
    # experimental: gate|up's LoRA delta added inside SiLU-and-multiply (kernels/lora_silu_mul.py) instead of an
    # expand that reads and writes gate|up's whole output; measured slower on the H200 (run 9) and in decode steps on
    # an H100 (run 28: +0.7-0.9 ms a step), so off. With the expand's launch options (run 28, bench lora_plan
    # --silu) gate|up + SiLU is still 0.04-1.2 ms slower per decode step wherever more than one adapter is in it
    fuse_lora_silu_mul: bool = False
    # steps of at least this many tokens (0: never) add gate|up's delta inside SiLU-and-multiply as
    # fuse_lora_silu_mul does for every step: in a prompt step the expand's write of gate|up's output (2 x 14,336
    # columns a token) is the largest part of the LoRA work's traffic
    lora_silu_mul_min_tokens: int = 0
    # the LoRA shrink of each projection on a forked CUDA stream while the base GEMM runs (LoRAStep.linear), the
    # expand after both; CUDA only (elsewhere ignored)
    lora_overlap_shrink: bool = False
    # steps of at least this many tokens (0: never) run each projection's LoRA shrink and a write-only expand before
    # the base GEMM, which then accumulates into that output (cuBLAS beta = 1): one pass less over every projection's
    # output (LoRAStep._expand_first_linear). CUDA only. On the H200 (run 14) it cut the LoRA work between the GEMMs
    # of an 8,192-token step from 19.3 to 14.0 ms and of a 2,048-token step from 5.9 to 4.8 ms (32 adapters), and
    # raised offline zipf/uniform by 1.5-2.5%. Since the expand zeroes the rows of tokens without an adapter itself
    # (no memset in decode graphs), it also pays at the offline workloads' 248-token decode steps: threshold 128
    # against 2,048, same call, ABBA (run 20): distinct's decode steps -4.5%, zipf's unchanged; at 64 tokens a wash
    lora_expand_first_min_tokens: int = 128
    # eager steps of 3,584 tokens or more (lora_ops.PREFILL_TILES_MIN_TOKENS) whose tokens sit mostly in requests of
    # more than 32 tokens get the LoRA kernels' prefill tiles even when their mean per adapter is 32 or less (a step
    # admitting ~30 prompts while ~230 requests decode on distinct adapters: ~29 per adapter). Off: on an H200 the
    # offline A/B (run 24) gave distinct 7,943 (off) against 7,919 tok/s and zipf 9,407 against 9,415, and mixed_step
    # timed the 7,535-token offline step's LoRA work at 20.04 ms (decode tiles) against 19.81 (prefill); on an H100 a
    # 4,096-token step of 200 decodes and one 3,896-token prompt on distinct adapters: 15.39 against 17.20 ms
    lora_segment_tiles: bool = False
    # pure-decode steps of at most lora_gemm_shrink_max_tokens tokens run each projection's LoRA shrink inside its base
    # GEMM: every slot's A rows sit under the base weight (SlotPool.fold_base_weights, at start-up) and one cuBLAS GEMM,
    # over the base rows and the A rows of the first W slots, gives the base output and those slots' y, then the
    # expand. W (LoRAManager.gemm_shrink_width): the narrowest of 4, 8, 16, ... max_loras above the step's highest slot
    # (adapters take the lowest free slot), which its distinct adapters must fill at least half of, with rows x W <=
    # 128 x 128 and, above 128 rows, W <= 32 (beyond, the GEMM is compute-bound: 256 tokens on 256 slots lost on the
    # H200, run 18, and 248 on 64, run 30). On the H200 it cut the LoRA work between the GEMMs of a 64-token step on 64
    # distinct adapters (64 slots) from 2.57 to 2.14 ms; 31 adapters on 32 slots at 248 sequences: decode steps
    # -0.11 ms on the H200 (run 30), -0.39 ms on an H100 (run 29). CUDA graphs keep a
    # variant per width. CUDA only, bf16/fp16 weights that are not quantized, one GPU, no projection biases
    # (otherwise ignored). Off by default
    lora_gemm_shrink: bool = False
    lora_gemm_shrink_max_tokens: int = 64
    # steps of at most this many tokens (0: never) run the down projection's LoRA shrink inside the SiLU-and-multiply
    # launch, whose extra programs recompute their tiles of silu(gate) * up from gate|up (kernels/lora_fold.py): one
    # launch fewer per layer. Triton only; not with fuse_lora_silu_mul / lora_silu_mul_min_tokens steps. Off: slower
    # on an H100 (run 32, docs/benchmarks/H100-2026-12-07-run32.md), decode steps +0.72 ms (zipf) and +1.81 ms
    # (distinct), each shrink program recomputing silu for whole 16-row tiles of mostly masked rows
    lora_fold_shrink_max_tokens: int = 0
    # with lora_gemm_shrink, a decode step whose adapters could fill half of a width W but some of which sit at or above
    # slot W (the first slots hold adapters that stopped running) moves up to this many of them below W, one or two
    # device copies of a slot each (LoRAManager._gather_low); 0: never
    lora_gemm_shrink_max_moves: int = 8
    # after the engine loads, freeze the heap alive then out of the cyclic GC's reach (engine/gc_heap.py): shorter
    # full collections. For processes that exist to run the engine (the server and the benchmarks set it); off for
    # a library caller, whose heap it would freeze too
    freeze_gc: bool = False
    # in a step that mixes decodes and prompts, the leading one-token sequences run through the split-KV decode
    # kernel and only the rest through the varlen (prefill) kernel, instead of every row through the varlen kernel
    # (whose 16-row query tiles a decode row fills alone); off only for A/B runs
    attention_decode_split: bool = True
    # CUDA graphs for the steps that are not pure decode (prefill, mixed), captured piecewise around attention
    # (engine/piecewise_graphs.py) for steps of up to piecewise_graph_max_tokens tokens; larger steps run eagerly.
    # (H200, run 12: a mixed step of 248 decodes + a 384-token prompt on 64 adapters 52.9 -> 23.7 ms; base 18.5 -> 19.4)
    # Off with enforce_eager, or alone for A/B runs
    piecewise_cuda_graphs: bool = True
    piecewise_graph_max_tokens: int = 2048
    # weight quantization of the base model's projections (engine/quant.py): None (the checkpoint's weights), "int8"
    # or "fp8" (e4m3) weight-only, one scale per output row: half the weight bytes of bf16, activations and LoRA
    # unchanged
    quantization: str | None = None
    # speculative decoding (engine/spec_decode.py): up to this many draft tokens per decoding sequence per step,
    # verified by the model in the same step (0 = off). "ngram": prompt lookup, the tokens that followed the latest
    # earlier occurrence of the context's last prompt_lookup_max .. prompt_lookup_min tokens. Greedy and plain
    # random sampling (temperature, top-k, top-p, min-p) keep their exact output distribution; other requests
    # decode one token per step. Steps with drafts run without the decode CUDA graphs, and overlapped steps
    # (async_scheduling) stay off unless asked for
    num_speculative_tokens: int = 0
    speculative_method: str = "ngram"
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    # tensor parallelism (engine/parallel.py): the model's heads and intermediate size split over this many ranks,
    # one GPU each (cuda:0 .. cuda:P-1 from the configured device; NCCL), or CPU processes (gloo); rank 0 is this
    # process, the others are worker processes the engine starts and stops (LLMEngine.shutdown)
    tensor_parallel_size: int = 1
    model_id: str | None = None  # served name; default the model directory's name

    def __post_init__(self) -> None:
        self.dtype = _dtype_name(self.dtype)
        if self.seed is None:  # drawn here, once: every rank and the batch command's per-line seeds see this one
            self.seed = secrets.randbits(63)
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or not -(2**63) <= self.seed < 2**64:
            raise ValueError(f"seed must be an integer (a 64-bit one) or None, got {self.seed!r}")
        for name in ("model", "tokenizer"):
            if isinstance(getattr(self, name), os.PathLike):
                setattr(self, name, os.fspath(getattr(self, name)))
        _check_field_types(self)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got "
                             f"{self.kv_cache_dtype!r}")
        if not 0 < self.gpu_memory_utilization <= 1:  # NaN fails too
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if not 0 < self.kv_cache_memory_gb < math.inf:
            raise ValueError(f"kv_cache_memory_gb must be a finite number > 0, got {self.kv_cache_memory_gb}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.merge_single_lora and not self.enable_lora:
            raise ValueError("merge_single_lora needs enable_lora")
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.prefill_batch_min_tokens < 0:
            raise ValueError(f"prefill_batch_min_tokens must be >= 0, got {self.prefill_batch_min_tokens}")
        if self.prefill_batch_min_running < 0:
            raise ValueError(f"prefill_batch_min_running must be >= 0, got {self.prefill_batch_min_running}")
        if self.prefill_batch_max_wait_steps < 1:
            raise ValueError(f"prefill_batch_max_wait_steps must be >= 1, got {self.prefill_batch_max_wait_steps}")
        if self.lora_group_max_skips < 0:
            raise ValueError(f"lora_group_max_skips must be >= 0, got {self.lora_group_max_skips}")
        if self.lora_expand_first_min_tokens < 0:
            raise ValueError(f"lora_expand_first_min_tokens must be >= 0, got {self.lora_expand_first_min_tokens}")
        if self.lora_fold_shrink_max_tokens < 0:
            raise ValueError(f"lora_fold_shrink_max_tokens must be >= 0, got {self.lora_fold_shrink_max_tokens}")
        if self.lora_silu_mul_min_tokens < 0:
            raise ValueError(f"lora_silu_mul_min_tokens must be >= 0, got {self.lora_silu_mul_min_tokens}")
        if self.lora_gemm_shrink_max_moves < 0:
            raise ValueError(f"lora_gemm_shrink_max_moves must be >= 0, got {self.lora_gemm_shrink_max_moves}")
        if self.lora_gemm_shrink_max_tokens < 1:
            raise ValueError(f"lora_gemm_shrink_max_tokens must be >= 1, got {self.lora_gemm_shrink_max_tokens}")
        if self.piecewise_graph_max_tokens < 1:
            raise ValueError(f"piecewise_graph_max_tokens must be >= 1, got {self.piecewise_graph_max_tokens}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2 (a prompt token and a generated one), got {self.max_model_len}")
        if self.quantization is not None:
            from loraplex.engine.quant import QUANTIZATIONS

            if self.quantization not in QUANTIZATIONS:
                raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)} (or None), got "
                                 f"{self.quantization!r}")
            if self.merge_single_lora:
                raise ValueError("merge_single_lora cannot fold an adapter into quantized weights: turn one off")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}")
        if self.num_speculative_tokens:
            from loraplex.engine.spec_decode import SPEC_METHODS, check_lookup_sizes

            if self.speculative_method not in SPEC_METHODS:
                raise ValueError(f"speculative_method must be one of {', '.join(SPEC_METHODS)}, got "
                                 f"{self.speculative_method!r}")
            check_lookup_sizes(self.prompt_lookup_min, self.prompt_lookup_max)
        self._check_device()
        if self.model_id is None and self.model:
            self.model_id = served_model_id(self.model)

    def _check_device(self) -> None:
        """``cpu``, ``cuda`` or ``cuda:N`` naming a GPU this process can use (a clear error, not an assertion from
        deep inside torch, on a machine or a torch build without one)."""
        import torch

        try:
            device = torch.device(self.device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}") from exc
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if device.type == "cuda":
            if not torch.cuda.is_available():
                build = "a CPU-only build" if torch.version.cuda is None else "no GPU visible to this process"
                raise ValueError(f"device {self.device!r}: CUDA is not available (torch {torch.__version__}, "
                                 f"{build}); use device='cpu'")
            if device.index is not None and device.index >= torch.cuda.device_count():
                raise ValueError(f"device {self.device!r}: this process sees {torch.cuda.device_count()} GPU(s)")

    def resolve(self, max_position_embeddings: int) -> None:
        """Fill the limits that depend on the model."""
        if self.max_model_len is None:
            self.max_model_len = max_position_embeddings
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = max(2048, min(self.max_model_len, 8192))
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
