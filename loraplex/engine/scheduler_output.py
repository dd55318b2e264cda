"""What the scheduler hands the model runner each step, and what comes back (pure Python)."""

from __future__ import annotations

from dataclasses import dataclass, field

from loraplex.engine.request import Request, TokenLogprobs

# A sequence's newest token while the step that samples it is still running (overlapped steps): the runner
# reads the real token on the device; the host replaces the placeholder when the step's results arrive.
PLACEHOLDER_TOKEN = -1


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens computed this step, from request.num_computed_tokens on
    num_samples: int  # tokens to sample from its last position: 0 (prompt chunk), 1, or n (fork)
    # speculative decoding: the draft tokens computed after the sequence's newest token (num_new_tokens = 1 + k);
    # the step emits 1 to k + 1 tokens for it (engine/spec_decode.py)
    draft_token_ids: list[int] | None = None

    @property
    def wants_prompt_logprobs(self) -> bool:
        req = self.request
        return (req.sampling_params.prompt_logprobs is not None
                and req.num_computed_tokens < req.num_prompt_tokens
                and len(req.prompt_logprobs) < req.num_prompt_tokens)


@dataclass
class SchedulerOutput:
    """One step: the batch (in order), block copies to make before the forward, and the adapters used.

    The runner reads each request's tokens, positions and block table directly from the ``Request``
    objects (same process); nothing else about the step lives outside this object."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) block ids
    lora_ids: set[int] = field(default_factory=set)  # distinct non-zero adapter ids in the step
    preempted: list[Request] = field(default_factory=list)
    # a sequence computes a prompt chunk (the step runs without a decode CUDA graph); in any step where some sequence
    # computes more than one token (a prompt chunk or a draft), the one-token sequences are listed first
    has_prompt_chunks: bool = False
    num_draft_tokens: int = 0  # draft tokens in the step (speculative decoding): sampled synchronously

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class ModelRunnerOutput:
    """Keyed by ``Request.seq_id``: the sampled tokens (n of them for a fork) and their logprobs."""

    sampled_token_ids: dict[int, list[int]] = field(default_factory=dict)
    sampled_logprobs: dict[int, list[float]] = field(default_factory=dict)  # raw logprob of each sample
    logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)  # when asked for
    prompt_logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)  # this chunk's
