"""Request limits -> 400 naming the parameter, before anything reaches the engine.

Limits: ``max_tokens`` (``Settings.max_tokens_limit`` and the context), ``n`` (``max_n``), number and
length of stop strings (``max_stop_sequences``), prompt length against ``max_model_len``, number and length of
``bad_words``, entries of ``allowed_token_ids`` and ``logit_bias`` (the vocabulary size). Token ids themselves
are checked against the vocabulary by the engine (``SamplingParams.check_token_ids``).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from loraplex.engine.sampling_params import SamplingParams, SamplingParamsError, truncation_size
from loraplex.platform.errors import bad_request, invalid_type
from loraplex.settings import Settings

MAX_STOP_STRING_CHARS = 256
MAX_SEED = 2**63 - 1
MAX_PROMPTS = 64
MAX_STOP_TOKEN_IDS = 64
MAX_BAD_WORDS = 64  # the engine encodes each one (twice) when it admits the request
MAX_BAD_WORD_CHARS = 256


@dataclass(frozen=True)
class Limits:
    max_tokens_limit: int
    max_n: int
    max_stop_sequences: int
    max_model_len: int

    @classmethod
    def from_settings(cls, settings: Settings, max_model_len: int) -> Limits:
        return cls(settings.max_tokens_limit, settings.max_n, settings.max_stop_sequences, max_model_len)


def normalize_stop(stop: str | list[str] | None, limits: Limits) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > limits.max_stop_sequences:
        raise bad_request(f"At most {limits.max_stop_sequences} stop sequences are allowed, got {len(stops)}.",
                          param="stop")
    for s in stops:
        if not s:
            raise bad_request("Stop sequences must be non-empty strings.", param="stop")
        if len(s) > MAX_STOP_STRING_CHARS:
            raise bad_request(f"Each stop sequence must be at most {MAX_STOP_STRING_CHARS} characters.",
                              param="stop")
    return stops


def require_model(model: str) -> None:
    """An empty ``model`` is a missing one (OpenAI's 400), not a 404 for a model named ""."""
    if not model:
        raise bad_request("You must provide a model parameter.", param="model")


def check_message_contents(messages) -> None:
    """OpenAI's rule: a message's content may be null or left out only where the message says something else,
    an assistant's ``tool_calls`` or ``function_call`` (a user turn without content is no turn to answer)."""
    note = "Only an assistant message with tool_calls or function_call may have no content."
    for i, m in enumerate(messages):
        if m.content is not None and m.content is not msgspec.UNSET:
            continue
        if m.role == "assistant" and (m.tool_calls or m.function_call):
            continue
        param = f"messages[{i}].content"
        if m.content is None:
            raise invalid_type(param, "str | array", "null", note)
        raise bad_request(f"Missing required parameter: '{param}'. {note}", param=param)


def check_n(n: int | None, num_prompts: int, limits: Limits) -> int:
    n = 1 if n is None else n
    if n < 1 or n > limits.max_n:
        raise bad_request(f"n must be between 1 and {limits.max_n}, got {n}.", param="n")
    if n * num_prompts > limits.max_n:
        raise bad_request(f"n x number of prompts must be at most {limits.max_n}, got {n * num_prompts}.",
                          param="n")
    return n


def check_max_tokens(max_tokens: int | None, prompt_len: int, limits: Limits, param: str,
                     prompt_param: str) -> int:
    """The generation budget for a prompt of ``prompt_len`` tokens (default: the rest of the context)."""
    room = limits.max_model_len - prompt_len
    if room < 1:
        raise bad_request(
            f"This model's maximum context length is {limits.max_model_len} tokens; the prompt has {prompt_len} "
            f"tokens, leaving no room for a completion.", param=prompt_param, code="context_length_exceeded",
        )
    if max_tokens is None:
        return min(room, limits.max_tokens_limit)
    if max_tokens < 1 or max_tokens > limits.max_tokens_limit:
        raise bad_request(f"{param} must be between 1 and {limits.max_tokens_limit}, got {max_tokens}.",
                          param=param)
    if max_tokens > room:
        raise bad_request(
            f"This model's maximum context length is {limits.max_model_len} tokens; the prompt has {prompt_len} "
            f"tokens and {param} is {max_tokens} ({prompt_len + max_tokens} in total).", param=param,
            code="context_length_exceeded",
        )
    return max_tokens


def _check_range(value: float | int | None, lo: float, hi: float, param: str) -> None:
    if value is not None and not lo <= value <= hi:
        raise bad_request(f"{param} must be between {lo} and {hi}, got {value}.", param=param)


def check_token_restrictions(req, vocab_size: int | None) -> None:
    """Sizes of vLLM's ``bad_words`` and ``allowed_token_ids`` and OpenAI's ``logit_bias`` (their values are
    SamplingParams' to check): every entry costs the engine work, on its own thread."""
    words = req.bad_words or []
    if len(words) > MAX_BAD_WORDS:
        raise bad_request(f"At most {MAX_BAD_WORDS} bad_words are allowed, got {len(words)}.", param="bad_words")
    if any(len(w) > MAX_BAD_WORD_CHARS for w in words):
        raise bad_request(f"Each bad word must be at most {MAX_BAD_WORD_CHARS} characters.", param="bad_words")
    if vocab_size is None:
        return
    for param in ("allowed_token_ids", "logit_bias"):
        entries = getattr(req, param)
        if entries is not None and len(entries) > vocab_size:
            raise bad_request(f"{param} may have at most {vocab_size} entries (the vocabulary size), got "
                              f"{len(entries)}.", param=param)


def sampling_params(req, *, n: int, max_tokens: int, stop: list[str], logprobs: int | None,
                    prompt_logprobs: int | None = None) -> SamplingParams:
    """Build engine sampling params; every bad value becomes a 400 naming its field."""
    _check_range(req.temperature, 0.0, 2.0, "temperature")
    _check_range(req.top_p, 0.0, 1.0, "top_p")
    if req.seed is not None and not -MAX_SEED <= req.seed <= MAX_SEED:
        raise bad_request("seed must fit in a signed 64-bit integer.", param="seed")
    if req.top_k is not None and (req.top_k < -1 or req.top_k > 1_000_000):
        raise bad_request("top_k must be -1 (disabled) or between 1 and 1000000.", param="top_k")
    if req.min_tokens is not None and req.min_tokens > max_tokens:
        raise bad_request(f"min_tokens must be at most max_tokens ({max_tokens}).", param="min_tokens")
    try:
        return SamplingParams(
            n=n,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else (req.top_p or 1e-9),
            top_k=-1 if req.top_k is None else req.top_k,
            min_p=req.min_p or 0.0,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            seed=req.seed,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens or 0,
            stop=stop,
            stop_token_ids=list(req.stop_token_ids or []),
            include_stop_str_in_output=bool(req.include_stop_str_in_output),
            ignore_eos=bool(req.ignore_eos),
            skip_special_tokens=req.skip_special_tokens is not False,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            logit_bias=req.logit_bias or None,
            allowed_token_ids=req.allowed_token_ids,
            bad_words=req.bad_words or [],
        )
    except SamplingParamsError as exc:
        raise bad_request(str(exc), param=exc.param) from exc


def check_truncate_prompt_tokens(value: int | None, max_model_len: int) -> int | None:
    """vLLM's ``truncate_prompt_tokens``: how many of the prompt's last tokens to keep (-1: the context); the
    engine's rule (``truncation_size``), as the offline API applies it."""
    try:
        return truncation_size(value, max_model_len)
    except SamplingParamsError as exc:
        raise bad_request(str(exc), param=exc.param) from exc
