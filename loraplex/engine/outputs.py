"""Offline API results (vLLM-like names), assembled from the engine's token deltas."""

from __future__ import annotations

from dataclasses import dataclass, field

from loraplex.engine.protocol import TokenDelta, TopLogprob


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    cumulative_logprob: float | None = None  # None unless the request asked for logprobs (vLLM)
    error: str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0
    finished: bool = False


def _logprob_dict(entry: tuple[float, list[TopLogprob]] | None) -> dict[int, Logprob] | None:
    if entry is None:
        return None
    return {t.token_id: Logprob(t.logprob, t.rank, t.token) for t in entry[1]}


def apply_delta(out: RequestOutput, delta: TokenDelta) -> None:
    """Fold one delta into the request's output (the sample's entry is created on first use)."""
    comp = out.outputs[delta.index]
    comp.token_ids.extend(delta.token_ids)
    comp.text += delta.text
    if delta.logprobs is not None:
        comp.logprobs = (comp.logprobs or []) + [_logprob_dict(e) for e in delta.logprobs]
    if delta.prompt_logprobs is not None and out.prompt_logprobs is None:
        out.prompt_logprobs = [_logprob_dict(e) for e in delta.prompt_logprobs]
    out.num_cached_tokens = max(out.num_cached_tokens, delta.num_cached_tokens)
    if delta.finished:
        comp.finish_reason = delta.finish_reason
        comp.stop_reason = delta.stop_reason
        comp.error = delta.error
        comp.cumulative_logprob = delta.cumulative_logprob
        out.finished = all(c.finish_reason is not None for c in out.outputs)
