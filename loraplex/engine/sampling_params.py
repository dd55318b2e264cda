"""Sampling parameters (vLLM-compatible names). Pure Python: no torch import."""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property

# features of a row that need work in the sampler beyond argmax (``SamplingParams.sampler_flags``)
SAMPLE_RANDOM = 1  # temperature > 0
SAMPLE_PENALTIES = 2  # repetition, frequency or presence penalty
SAMPLE_SEEDED = 4
SAMPLE_TOP_K_P = 8
SAMPLE_MIN_P = 16
SAMPLE_LOGPROBS = 32
SAMPLE_PROMPT_LOGPROBS = 64  # runner work: logits of prompt positions
SAMPLE_LOGIT_BIAS = 128  # allowed_token_ids or logit_bias: a bias row made from the params alone
SAMPLE_BAD_WORDS = 256  # bad_words: bans that depend on the newest output tokens
SAMPLE_MIN_TOKENS = 512  # min_tokens: EOS and stop_token_ids banned until that many output tokens

MAX_LOGIT_BIAS = 100.0  # logit_bias values lie in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS] (OpenAI's range)


class SamplingParamsError(ValueError):
    """A bad sampling parameter; ``param`` names the field (the HTTP layer maps it to a 400)."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param
        self.detail = message  # the message without the field name (a caller may call the field otherwise)

    def __reduce__(self):  # pickled whole (the engine process sends refusals to the server): field and message
        return type(self), (self.param, self.detail)


class RequestLimitError(SamplingParamsError):
    """A request over a limit of this engine: ``param`` names the request field (``prompt``, ``max_tokens``
    or ``n``) and ``limit`` the largest value this engine takes (prompt tokens, max_tokens for this prompt,
    samples)."""

    def __init__(self, param: str, message: str, limit: int):
        super().__init__(param, message)
        self.limit = limit

    def __reduce__(self):
        return type(self), (self.param, self.detail, self.limit)


_INT_FIELDS = ("n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs",
               "truncate_prompt_tokens")
_OPTIONAL = frozenset({"seed", "max_tokens", "logprobs", "prompt_logprobs", "truncate_prompt_tokens"})
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
_BOOL_FIELDS = ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "detokenize")


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) = disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16  # None = up to the context length
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token (the sampled token always included)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True  # False: token ids only (text "", logprobs' decoded tokens None), as in vLLM
    # vLLM's token restrictions, applied before penalties and temperature (logprobs stay those of the raw model)
    logit_bias: dict[int, float] | None = None  # token id (an int, or its decimal string as in OpenAI) -> added
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] = field(default_factory=list)  # never completed (``bad_words_token_ids``)
    # vLLM's left truncation: only the prompt's last k tokens run (-1: max_model_len of them; None: the whole prompt)
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name in ("stop", "stop_token_ids", "bad_words"):
            value = getattr(self, name) or []
            if not isinstance(value, (list, tuple)):
                raise SamplingParamsError(name, f"must be a list, got {value!r}")
            setattr(self, name, list(value))
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, (list, tuple)):
                raise SamplingParamsError("allowed_token_ids", f"must be a list, got {self.allowed_token_ids!r}")
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.logit_bias is not None:
            self.logit_bias = _logit_bias(self.logit_bias)
        if self.top_k == 0:
            self.top_k = -1
        self.validate()

    def __setattr__(self, name: str, value) -> None:
        if self.__dict__.get("_snapshot"):
            raise AttributeError(f"{name}: this SamplingParams is a snapshot the engine runs and cannot change; "
                                 "set the field on the object you passed in, for the next request")
        super().__setattr__(name, value)

    def snapshot(self) -> SamplingParams:
        """A validated copy, read-only, made now: what the engine runs and derives its cached state from
        (``sampler_flags``, the sampler's bias arrays), so a caller may change and reuse its own object. A
        snapshot is its own snapshot, so passing one on costs nothing; making one copies its lists (once per request,
        never per token)."""
        if self.__dict__.get("_snapshot"):
            return self
        copy = dataclasses.replace(self)  # __init__: the lists copied, logit_bias rebuilt, everything validated
        copy.__dict__["_snapshot"] = True
        return copy

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @cached_property
    def sampler_flags(self) -> int:
        """``SAMPLE_*`` bits of the sampler work this request needs (computed once: the sampler ORs the
        batch's flags each step and skips every feature no row uses)."""
        flags = 0
        if not self.greedy:
            flags |= SAMPLE_RANDOM
            if self.seed is not None:
                flags |= SAMPLE_SEEDED
            if self.top_k > 0 or self.top_p < 1.0:
                flags |= SAMPLE_TOP_K_P
            if self.min_p:
                flags |= SAMPLE_MIN_P
        if self.repetition_penalty != 1.0 or self.presence_penalty or self.frequency_penalty:
            flags |= SAMPLE_PENALTIES
        if self.logprobs is not None:
            flags |= SAMPLE_LOGPROBS
        if self.prompt_logprobs is not None:
            flags |= SAMPLE_PROMPT_LOGPROBS
        if self.allowed_token_ids is not None or self.logit_bias:
            flags |= SAMPLE_LOGIT_BIAS
        if self.bad_words:
            flags |= SAMPLE_BAD_WORDS
        if self.min_tokens:
            flags |= SAMPLE_MIN_TOKENS
        return flags

    def bad_words_token_ids(self, encode: Callable[[str], list[int]]) -> list[list[int]]:
        """The token sequences ``bad_words`` ban, by vLLM's rule: each word with its leading spaces stripped, and
        once more after a single space (a word inside the text) where that gives a different first token and as
        many tokens (a tokenizer that spells the space as a token of its own would otherwise ban space + word).
        ``encode`` is the tokenizer's, without special tokens."""
        token_ids = []
        for word in self.bad_words:
            bare = list(encode(word.lstrip()))
            if not bare:  # no token spells it: nothing to ban
                continue
            token_ids.append(bare)
            spaced = list(encode(" " + word.lstrip()))
            if len(spaced) == len(bare) and spaced[0] != bare[0]:
                token_ids.append(spaced)
        return token_ids

    def check_token_ids(self, vocab_size: int, bad_words_token_ids: Sequence[Sequence[int]] = ()) -> None:
        """The request's token ids lie inside the model's vocabulary (the engine knows its size; an id outside
        it would fail the whole batch's step)."""
        for name, ids in (("allowed_token_ids", self.allowed_token_ids or ()), ("logit_bias", self.logit_bias or {}),
                          ("bad_words", [t for word in bad_words_token_ids for t in word])):
            if ids and max(ids) >= vocab_size:
                raise SamplingParamsError(name, f"token id {max(ids)} is outside the model's vocabulary "
                                                f"[0, {vocab_size})")
        if self.allowed_token_ids and set(self.allowed_token_ids) <= {w[0] for w in bad_words_token_ids if len(w) == 1}:
            raise SamplingParamsError("bad_words", "bans every token of allowed_token_ids: nothing could be sampled")

    def prompt_tokens_kept(self, max_model_len: int) -> int | None:
        """How many of the prompt's last tokens run (``truncate_prompt_tokens``; None: all of them)."""
        return truncation_size(self.truncate_prompt_tokens, max_model_len)

    def validate(self) -> None:
        def bad(param: str, msg: str) -> None:
            raise SamplingParamsError(param, msg)

        # types first: a float where an index is expected (top_k, logprobs) or a string seed would
        # otherwise pass the range checks and fail inside the engine's step
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if not (value is None and name in _OPTIONAL) and not _is_int(value):
                bad(name, f"must be an integer{' or None' if name in _OPTIONAL else ''}, got {value!r}")
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                bad(name, f"must be a number, got {value!r}")
        for name in _BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                bad(name, f"must be true or false, got {getattr(self, name)!r}")
        if not all(_is_int(t) for t in self.stop_token_ids):
            bad("stop_token_ids", f"must be a list of integers, got {self.stop_token_ids!r}")
        if self.n < 1:
            bad("n", f"must be an integer >= 1, got {self.n!r}")
        if not 0 <= self.temperature < math.inf:  # NaN fails too (it sampled token 0 at every step)
            bad("temperature", f"must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            bad("top_k", f"must be -1 (disabled) or >= 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if not -2 <= self.presence_penalty <= 2:
            bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if not 0 < self.repetition_penalty <= 10:
            bad("repetition_penalty", f"must be in (0, 10], got {self.repetition_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            bad("min_tokens", f"must be in [0, max_tokens], got {self.min_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            bad("logprobs", f"must be in [0, 20], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            bad("prompt_logprobs", f"must be in [0, 20], got {self.prompt_logprobs}")
        if self.truncate_prompt_tokens is not None and not (self.truncate_prompt_tokens >= 1
                                                            or self.truncate_prompt_tokens == -1):
            bad("truncate_prompt_tokens", f"must be an integer >= 1, or -1 (max_model_len), got "
                                          f"{self.truncate_prompt_tokens}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "stop strings must be non-empty strings")
        if self.stop and not self.detokenize:  # vLLM refuses it too: stop strings match the detokenized text
            bad("stop", "stop strings need detokenize=True (they match the output's text, which detokenize=False "
                        "does not make); use stop_token_ids")
        if any(not isinstance(w, str) for w in self.bad_words):
            bad("bad_words", f"must be a list of strings, got {self.bad_words!r}")
        if any(not w.strip() for w in self.bad_words):
            bad("bad_words", "a bad word must not be empty (or only spaces)")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                bad("allowed_token_ids", "must not be empty (leave it out to allow every token)")
            if not all(_is_int(t) for t in self.allowed_token_ids):
                bad("allowed_token_ids", f"must be a list of integers, got {self.allowed_token_ids!r}")
            if min(self.allowed_token_ids) < 0:
                bad("allowed_token_ids", f"token ids must be >= 0, got {min(self.allowed_token_ids)}")


def truncation_size(truncate_prompt_tokens: int | None, max_model_len: int) -> int | None:
    """vLLM's ``truncate_prompt_tokens`` against an engine's ``max_model_len``: how many of the prompt's last tokens
    to keep (-1: ``max_model_len``; None: no truncation). SamplingParamsError outside -1 and [1, max_model_len]."""
    value = truncate_prompt_tokens
    if value is None:
        return None
    if value == -1:
        return max_model_len
    if not _is_int(value) or not 1 <= value <= max_model_len:
        raise SamplingParamsError("truncate_prompt_tokens", f"must be -1 (max_model_len) or between 1 and "
                                                            f"{max_model_len} (max_model_len), got {value!r}")
    return value


def snapshots(params: Sequence[SamplingParams]) -> list[SamplingParams]:
    """``p.snapshot()`` of each, one per distinct object (requests sharing a params object share its snapshot,
    and so the sampler's arrays made from it)."""
    copies: dict[int, SamplingParams] = {}
    for p in params:
        if id(p) not in copies:
            copies[id(p)] = p.snapshot()
    return [copies[id(p)] for p in params]


def _logit_bias(value) -> dict[int, float]:
    """``logit_bias`` with int keys (OpenAI sends token ids as strings) and float values, checked."""
    def bad(msg: str):
        return SamplingParamsError("logit_bias", msg)

    if not isinstance(value, dict):
        raise bad(f"must be an object (a dict) of token id -> bias, got {value!r}")
    out = {}
    for key, bias in value.items():
        try:
            if not (_is_int(key) or isinstance(key, str)):
                raise ValueError
            token = int(key)
        except ValueError:
            raise bad(f"keys must be token ids (integers, or their decimal strings), got {key!r}") from None
        if token < 0:
            raise bad(f"token ids must be >= 0, got {token}")
        if isinstance(bias, bool) or not isinstance(bias, numbers.Real):
            raise bad(f"the bias of token {token} must be a number, got {bias!r}")
        if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:  # NaN fails too
            raise bad(f"the bias of token {token} must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias}")
        out[token] = float(bias)
    return out
