"""The contract between the platform (HTTP) and the engine. Pure Python: no torch import.

The platform builds :class:`EngineRequest` objects, has the engine admit them
(:meth:`EngineClient.add_requests`: a refusal raises there, before any response starts) and iterates
:class:`TokenDelta` objects from each returned :class:`DeltaStream`; the engine runs in its own thread or process so the HTTP event
loop never stalls a GPU step.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from loraplex.engine.lora_request import LoRARequest
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.token_bytes import TokenBytes


@dataclass
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    lora_request: LoRARequest | None = None
    tenant_id: str | None = None
    # set by the server from the tenant (HMAC), never by a client; part of every prefix-cache key
    cache_salt: str | None = None
    priority: int = 0  # lower runs first
    arrival_time: float = field(default_factory=time.monotonic)


@dataclass
class TopLogprob:
    token_id: int
    logprob: float
    token: str | None  # None for a request with detokenize=False (as vLLM's decoded_token)
    rank: int | None = None  # 1 = the most likely token


@dataclass(slots=True)  # one per request per step: slots make it cheaper to build
class TokenDelta:
    """New output of one sample (``index`` of ``n``) since the last delta."""

    request_id: str
    index: int
    token_ids: list[int]
    text: str
    # one entry per new token: (sampled token logprob, top-N alternatives) when logprobs were asked for;
    # the alternatives also hold the sampled token (with its rank) when it is not among the top N
    logprobs: list[tuple[float, list[TopLogprob]]] | None = None
    # on the first delta of each sample when prompt_logprobs was asked for: one entry per prompt token,
    # None for the first (nothing predicts it)
    prompt_logprobs: list[tuple[float, list[TopLogprob]] | None] | None = None
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None  # the stop string or stop token id that matched
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # prompt tokens the engine ran (prefix-cache hits included); below num_prompt_tokens only when the request
    # was aborted or failed before its prompt was done (0 if it never left the waiting queue)
    num_computed_prompt_tokens: int = 0
    num_generated_tokens: int = 0  # cumulative for this sample
    cumulative_logprob: float | None = None  # sum of the sampled tokens' logprobs so far (None: logprobs not asked)
    error: str | None = None
    # timings (monotonic seconds) for metering: set on the first delta / the final one
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # 0..1
    prefix_cache_hit_rate: float = 0.0
    num_preemptions: int = 0
    active_adapters: list[str] = field(default_factory=list)  # names resident on the device
    running_adapters: list[str] = field(default_factory=list)  # names used by running requests
    waiting_adapters: list[str] = field(default_factory=list)  # names used by the next waiting requests
    tokens_per_second: float = 0.0
    num_lora_loads: int = 0
    num_lora_evictions: int = 0
    lora_load_queue_depth: int = 0  # adapter reads queued or running in the background
    lora_host_load_seconds: float = 0.0  # total time spent reading and validating adapter files
    num_lora_load_failures: int = 0
    num_lora_host_loads: int = 0  # adapter files read into host memory
    num_lora_merges: int = 0  # merge_single_lora: adapters folded into the weights
    num_lora_merged_steps: int = 0  # steps run on merged weights
    # the server's engine loop thread (AsyncEngine), since start: steps run, seconds inside engine.step() and
    # seconds handing the steps' deltas to the callers' event loops
    loop_steps: int = 0
    loop_step_seconds: float = 0.0
    loop_step_cpu_seconds: float = 0.0  # the loop thread's own CPU time inside its steps (time.thread_time)
    loop_dispatch_seconds: float = 0.0
    device_wait_seconds: float = 0.0  # inside the steps: waiting for the device (sampled tokens, input copies)
    step_seqs: int = 0  # sequences scheduled, summed over the engine's steps since start (÷ steps: the mean batch)
    prompt_steps: int = 0  # steps that carried prompt chunks (more tokens than sequences: no decode CUDA graph)
    piecewise_graph_steps: int = 0  # of all steps, those that replayed piecewise CUDA graphs (prefill / mixed)
    spec_draft_tokens: int = 0  # speculative decoding: draft tokens verified since start
    spec_accepted_tokens: int = 0  # of those, accepted
    # the KV cache as configured (vllm:cache_config_info)
    num_kv_blocks: int = 0
    block_size: int = 0
    kv_cache_dtype: str = ""  # the element type: bfloat16, float8_e4m3fn, ...
    enable_prefix_caching: bool = True


class EngineDeadError(RuntimeError):
    """The engine loop died; in-flight and new requests fail with this."""


class DeltaStream(Protocol):
    """One admitted request's deltas (every sample's), ending after each sample's final delta."""

    request_id: str

    @property
    def done(self) -> bool: ...  # every sample's final delta has been read from it

    def __aiter__(self) -> AsyncIterator[TokenDelta]: ...

    async def __anext__(self) -> TokenDelta: ...

    def close(self) -> None: ...  # before the end: aborts the request

    async def drain(self, timeout_s: float) -> list[TokenDelta]: ...  # after close(): up to the final deltas


class EngineClient(Protocol):
    model_id: str
    max_model_len: int

    async def add_requests(self, requests: Sequence[EngineRequest]) -> list[DeltaStream]:
        """Admit all of ``requests`` or none: a refusal raises ``ValueError`` (``SamplingParamsError`` when it
        names a field) and leaves nothing running."""
        ...

    def generate(self, request: EngineRequest) -> AsyncIterator[TokenDelta]: ...

    async def abort(self, request_id: str) -> None: ...

    def is_healthy(self) -> bool: ...

    def stats(self) -> EngineStats: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    token_bytes: TokenBytes  # token id -> its raw bytes, cached (logprobs' ``bytes``)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            continue_final_message: bool = False,
                            template_kwargs: dict | None = None) -> list[int]: ...

    async def remove_adapter(self, adapter_id: int) -> None: ...

    async def shutdown(self) -> None: ...
