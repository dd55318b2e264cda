"""Request state (pure Python, no torch): one ``Request`` is one sample sequence of a user request.

A user request with ``n > 1`` starts as one sequence (sample 0); when its prompt has been computed the
scheduler forks ``n - 1`` siblings that share the prompt's KV blocks (copy-on-write).
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from loraplex.engine.lora_request import LoRARequest
from loraplex.engine.sampling_params import SamplingParams

_seq_counter = itertools.count()


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.finished else None


_FINISHED = {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED,
             RequestStatus.FINISHED_ERROR}


@dataclass
class TokenLogprobs:
    """Logprob of one generated (or prompt) token and the top-N alternatives (raw model distribution)."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    lora_request: LoRARequest | None = None
    cache_salt: str | None = None
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    index: int = 0  # which of the n samples
    prompt: str | None = None
    seq_id: int = field(default_factory=lambda: next(_seq_counter))
    # ``sampling_params.bad_words`` as token sequences (the engine encodes them with its tokenizer)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.token_ids: list[int] = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache (first admission)
        # how far the prompt has been run, cache hits included; not reset by preemption (what is billed)
        self.num_computed_prompt_tokens = 0
        self.block_ids: list[int] = []
        self.block_hashes: list[bytes] = []  # prefix-cache keys of this sequence's full blocks, in order
        self.num_registered_blocks = 0  # leading blocks whose key the block manager has recorded
        self.num_pending_forks = self.sampling_params.n - 1 if self.index == 0 else 0
        self.num_preemptions = 0
        self.stop_reason: str | int | None = None
        self.error: str | None = None
        self.cumulative_logprob = 0.0
        self.logprobs: list[TokenLogprobs] = []  # one per output token when asked for
        self.prompt_logprobs: list[TokenLogprobs | None] = []  # [0] is None, when asked for
        self.detokenizer: Any = None  # set by the engine (incremental text + stop strings)
        self.num_deltas = 0  # streaming progress: deltas, tokens and characters already sent
        self.num_sent_tokens = 0
        self.num_sent_chars = 0
        self.wait_steps = 0  # steps spent kept out by the adapter limit
        # overlapped steps: the token still in flight certainly ends this sequence (max_tokens or the context
        # limit), so the scheduler does not run it again
        self.finishing = False
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None

    # ---- derived -------------------------------------------------------------------------------
    @property
    def lora_id(self) -> int:
        return self.lora_request.lora_int_id if self.lora_request else 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def sort_key(self) -> tuple[int, float, int]:
        """Scheduling order: lower priority value first, then arrival (FCFS), then sample index."""
        return (self.priority, self.arrival_time, self.index)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def fork(self, index: int) -> Request:
        """A sibling sample sharing everything computed so far (the caller shares the KV blocks)."""
        child = Request(
            request_id=self.request_id, prompt_token_ids=self.prompt_token_ids,
            sampling_params=self.sampling_params, eos_token_ids=self.eos_token_ids,
            lora_request=self.lora_request, cache_salt=self.cache_salt, priority=self.priority,
            arrival_time=self.arrival_time, index=index, prompt=self.prompt,
            bad_words_token_ids=self.bad_words_token_ids,
        )
        child.token_ids = list(self.token_ids)
        child.num_computed_tokens = self.num_computed_tokens
        child.num_cached_tokens = self.num_cached_tokens
        child.num_computed_prompt_tokens = self.num_computed_prompt_tokens
        child.block_hashes = list(self.block_hashes)
        child.num_registered_blocks = self.num_registered_blocks
        child.status = self.status
        child.prompt_logprobs = self.prompt_logprobs
        child.first_scheduled_time = self.first_scheduled_time
        return child

    # ---- updates -------------------------------------------------------------------------------
    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        if self.detokenizer is not None:
            self.detokenizer.append(token_id)

    @property
    def min_tokens_ban(self) -> tuple[int, ...]:
        """The tokens that would end this sequence (EOS unless ignore_eos, stop_token_ids): the sampler bans them
        while fewer than ``min_tokens`` have been generated (empty without min_tokens)."""
        params = self.sampling_params
        if not params.min_tokens:
            return ()
        eos = () if params.ignore_eos else tuple(self.eos_token_ids)
        return tuple(sorted({*eos, *(params.stop_token_ids or ())}))

    def check_stop(self, max_model_len: int) -> RequestStatus | None:
        """Stop conditions after a new token, in vLLM's order. Sets ``stop_reason``."""
        params = self.sampling_params
        num_tokens = len(self.token_ids)
        num_out = num_tokens - self.num_prompt_tokens
        if num_out >= params.min_tokens:
            last = self.token_ids[-1]
            if not params.ignore_eos and last in self.eos_token_ids:
                self._drop_stop_token_text()
                return RequestStatus.FINISHED_STOPPED
            if params.stop_token_ids and last in params.stop_token_ids:
                self.stop_reason = last
                self._drop_stop_token_text()
                return RequestStatus.FINISHED_STOPPED
            if params.stop and self.detokenizer is not None:
                matched = self.detokenizer.check_stop_strings(params.stop, params.include_stop_str_in_output)
                if matched is not None:
                    self.stop_reason = matched
                    return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and num_out >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _drop_stop_token_text(self) -> None:
        """The token that stopped the sequence (EOS or a stop token id) stays in ``token_ids`` but adds no text,
        unless ``include_stop_str_in_output`` (vLLM's rule). It is the newest token and no delta has sent its text
        yet (deltas are made after the stop checks)."""
        if self.detokenizer is not None and not self.sampling_params.include_stop_str_in_output:
            self.detokenizer.drop_last_text()
