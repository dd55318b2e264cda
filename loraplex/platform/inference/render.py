"""Engine deltas -> OpenAI response objects and stream chunks."""

from __future__ import annotations

from dataclasses import dataclass, field

from loraplex.engine.protocol import TokenDelta, TopLogprob
from loraplex.platform.inference import schemas as s

_FINISH = {"stop": "stop", "length": "length"}


def finish_reason(engine_reason: str | None) -> str | None:
    if engine_reason is None:
        return None
    return _FINISH.get(engine_reason, "stop")


def usage(prompt: int, completion: int, cached: int) -> s.Usage:
    return s.Usage(prompt, completion, prompt + completion, s.PromptTokensDetails(cached_tokens=cached))


def _token_text(engine, token_id: int, tops: list[TopLogprob]) -> str:
    for t in tops:
        if t.token_id == token_id:
            return t.token
    tokenizer = getattr(engine, "tokenizer", None)
    return tokenizer.decode([token_id]) if tokenizer is not None else ""


def _completion_name(engine, token_id: int, text: str) -> str:
    """A token as /v1/completions names it (``tokens``, ``top_logprobs`` keys): its text, or for a token whose
    bytes are not UTF-8 on their own (decoded, every such token reads U+FFFD) ``bytes:`` and its escaped bytes
    (``bytes:\\xe2\\x80``), as OpenAI names them, so different tokens keep different keys."""
    escaped = engine.token_bytes.escaped(token_id)
    return text if escaped is None else "bytes:" + escaped


def _chat_entry(engine, token_id: int, text: str) -> tuple[str, list[int]]:
    """A token as chat logprobs show it: (``token``, ``bytes``). ``bytes`` are the token's own (a partial
    character's bytes, which a client joins with its neighbours'); ``token`` is its text, or those bytes
    escaped (``\\xe2\\x80``) when they are not UTF-8 on their own."""
    escaped = engine.token_bytes.escaped(token_id)
    return (text if escaped is None else escaped), list(engine.token_bytes(token_id))


def completion_logprobs(engine, delta: TokenDelta, offset: int) -> s.CompletionLogprobs | None:
    """The delta's tokens, their ``text_offset`` running on from ``offset`` by each token's name in ``tokens`` (as
    vLLM's run over the strings it returns), not by the text sent: held-back bytes or a cut stop string never give
    two tokens one offset."""
    if delta.logprobs is None:
        return None
    out = s.CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    for token_id, (lp, tops) in zip(delta.token_ids, delta.logprobs):
        name = _completion_name(engine, token_id, _token_text(engine, token_id, tops))
        out.tokens.append(name)
        out.token_logprobs.append(lp)
        out.top_logprobs.append(_top_by_name(engine, tops))
        out.text_offset.append(offset)
        offset += len(name)
    return out


def _top_by_name(engine, tops: list[TopLogprob]) -> dict[str, float]:
    return {_completion_name(engine, t.token_id, t.token): t.logprob for t in tops}


def end_offset(lp: s.CompletionLogprobs | None, offset: int) -> int:
    """Where the token after ``lp``'s last one starts (``offset`` when there is none)."""
    if lp is None or not lp.tokens:
        return offset
    return lp.text_offset[-1] + len(lp.tokens[-1])


def prompt_logprobs(engine, first_token: str, prompt_ids: list[int],
                    entries: list[tuple[float, list[TopLogprob]] | None]) -> s.CompletionLogprobs:
    """Echoed prompt tokens with their logprobs (OpenAI ``echo`` + ``logprobs``): None for the first token,
    which nothing predicts; ``first_token`` is its text (the other tokens' texts come with their entries)."""
    out = s.CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    offset = 0
    for token_id, entry in zip(prompt_ids, entries):
        lp, tops = (None, None) if entry is None else entry
        text = first_token if tops is None else next(t.token for t in tops if t.token_id == token_id)
        name = _completion_name(engine, token_id, text)
        out.tokens.append(name)
        out.token_logprobs.append(lp)
        out.top_logprobs.append(None if tops is None else _top_by_name(engine, tops))
        out.text_offset.append(offset)
        offset += len(name)
    return out


def vllm_prompt_logprobs(prompt_ids: list[int], entries: list[tuple[float, list[TopLogprob]] | None]
                         ) -> s.PromptLogprobs:
    """vLLM's ``prompt_logprobs``: for each prompt token (None for the first), the token and the top-N
    candidates by id, each with its logprob, rank and text."""
    out: s.PromptLogprobs = []
    for entry in entries[:len(prompt_ids)]:
        out.append(None if entry is None else
                   {t.token_id: s.PromptLogprob(t.logprob, t.rank, t.token) for t in entry[1]})
    return out


def concat_logprobs(parts: list[s.CompletionLogprobs | None]) -> s.CompletionLogprobs | None:
    parts = [p for p in parts if p is not None]
    if not parts:
        return None
    out = s.CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    for part in parts:
        out.tokens += part.tokens
        out.token_logprobs += part.token_logprobs
        out.top_logprobs += part.top_logprobs
        out.text_offset += part.text_offset
    return out


def chat_logprobs(engine, delta: TokenDelta, top_n: int) -> s.ChatLogprobs | None:
    if delta.logprobs is None:
        return None
    content = []
    for token_id, (lp, tops) in zip(delta.token_ids, delta.logprobs):
        token, raw = _chat_entry(engine, token_id, _token_text(engine, token_id, tops))
        content.append(s.ChatLogprobEntry(
            token=token, logprob=lp, bytes=raw,
            top_logprobs=[_chat_top(engine, t) for t in tops[:top_n]],
        ))
    return s.ChatLogprobs(content=content)


def _chat_top(engine, t: TopLogprob) -> s.TopLogprobOut:
    token, raw = _chat_entry(engine, t.token_id, t.token)
    return s.TopLogprobOut(token, t.logprob, raw)


@dataclass
class ChoiceAccumulator:
    """Collects one choice for a non-streaming response."""

    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[s.CompletionLogprobs] = field(default_factory=list)
    chat_logprobs: list[s.ChatLogprobEntry] = field(default_factory=list)
    offset: int = 0  # text_offset of the choice's next token
    prompt_logprobs: s.PromptLogprobs | None = None

    def finish(self, delta: TokenDelta) -> None:
        self.finish_reason = finish_reason(delta.finish_reason)
        self.stop_reason = delta.stop_reason

    def add_text(self, text: str) -> None:
        self.text.append(text)

    def add_completion_delta(self, engine, delta: TokenDelta) -> None:
        """A delta of a /v1/completions choice: its text, and its tokens' logprobs with text offsets running on."""
        lp = completion_logprobs(engine, delta, self.offset)
        if lp is not None:
            self.logprobs.append(lp)
            self.offset = end_offset(lp, self.offset)
        self.add_text(delta.text)
        if delta.finished:
            self.finish(delta)

    def add_chat_delta(self, engine, delta: TokenDelta, top_n: int) -> None:
        """A delta of a chat choice: its text, and its tokens' logprobs with ``top_n`` alternatives each."""
        lp = chat_logprobs(engine, delta, top_n)
        if lp is not None:
            self.chat_logprobs.extend(lp.content or [])
        self.add_text(delta.text)
        if delta.finished:
            self.finish(delta)

    def completion_logprobs(self) -> s.CompletionLogprobs | None:
        return concat_logprobs(self.logprobs)


def completion_choices(choices: list[ChoiceAccumulator]) -> list[s.CompletionChoice]:
    """A non-streamed /v1/completions response's choices, from their accumulators."""
    return [s.CompletionChoice(index=i, text="".join(c.text), logprobs=c.completion_logprobs(),
                               finish_reason=c.finish_reason or "stop", stop_reason=c.stop_reason,
                               prompt_logprobs=c.prompt_logprobs)
            for i, c in enumerate(choices)]


def chat_choices(choices: list[ChoiceAccumulator], role: str, with_logprobs: bool) -> list[s.ChatChoice]:
    """A non-streamed chat response's choices, from their accumulators."""
    return [s.ChatChoice(index=i, message=s.AssistantMessage(content="".join(c.text), role=role),
                         logprobs=s.ChatLogprobs(content=c.chat_logprobs) if with_logprobs else None,
                         finish_reason=c.finish_reason or "stop", stop_reason=c.stop_reason)
            for i, c in enumerate(choices)]
