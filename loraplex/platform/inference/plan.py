"""From an OpenAI request to what the engine runs: every check, limit and default the server applies to a
``/v1/completions`` or ``/v1/chat/completions`` body, as plain functions (no HTTP, no I/O, no await).

The routes (routes.py, pipeline.py) and ``loraplex batch``'s OpenAI format (loraplex/batch/openai_format.py) call
them in the same order, so one body gets the same answer, error or defaults wherever it is sent. Each raises the
:class:`ApiError` the server answers with. Tokenizing is the caller's: the server runs it on its tokenizer thread.

Order per request: :func:`check_completion` or :func:`check_chat` (fields this server refuses), the prompts
(:func:`completion_prompt_items` then encode; :func:`chat_template_call` then the template), :func:`truncate_prompts`,
the budget (:func:`completion_outputs`; :func:`chat_max_tokens`), then :func:`engine_params`.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
from jinja2 import TemplateError

from loraplex.engine.chat import ChatMessageError, chat_messages
from loraplex.engine.sampling_params import SamplingParams
from loraplex.platform.errors import ApiError, bad_request
from loraplex.platform.inference import schemas as s
from loraplex.platform.inference.chat_kwargs import template_kwargs
from loraplex.platform.inference.unsupported import refuse_unsupported
from loraplex.platform.inference.validation import (
    MAX_PROMPTS,
    MAX_STOP_TOKEN_IDS,
    Limits,
    check_max_tokens,
    check_message_contents,
    check_n,
    check_token_restrictions,
    check_truncate_prompt_tokens,
    normalize_stop,
    sampling_params,
)

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions (chat: the rest of the context)


# ---- fields refused -------------------------------------------------------------------------------


def check_completion(req: s.CompletionRequest) -> None:
    """A 400 naming the first field of a completion request this server cannot honour."""
    refuse_unsupported(req)
    if req.best_of is not None and req.best_of != (req.n or 1):
        raise ApiError(400, "best_of is not supported (use n).", param="best_of", code="unsupported")
    if req.suffix:
        raise ApiError(400, "suffix is not supported.", param="suffix", code="unsupported")


def check_chat(req: s.ChatCompletionRequest) -> int:
    """A 400 naming the first field of a chat request this server cannot honour, or the number of top logprobs
    each token is to come with."""
    refuse_unsupported(req)
    check_message_contents(req.messages)
    if req.top_logprobs is None:
        return 0
    if not req.logprobs:
        raise bad_request("top_logprobs needs logprobs=true.", param="top_logprobs")
    if not 0 <= req.top_logprobs <= 20:
        raise bad_request(f"top_logprobs must be between 0 and 20, got {req.top_logprobs}.", param="top_logprobs")
    return req.top_logprobs


# ---- prompts --------------------------------------------------------------------------------------


def check_ids(ids: list[int], vocab_size: int | None, param: str) -> list[int]:
    for t in ids:
        if t < 0 or (vocab_size is not None and t >= vocab_size):
            raise bad_request(f"Token id {t} is outside the model's vocabulary [0, {vocab_size}).", param=param)
    return ids


def completion_prompt_items(req: s.CompletionRequest, vocab_size: int | None) -> list[str | list[int]]:
    """The request's prompts: a string is to be encoded, a list of token ids is one prompt (checked against the
    vocabulary)."""
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if not p:
        raise bad_request("prompt must not be empty.", param="prompt")
    if all(isinstance(x, int) and not isinstance(x, bool) for x in p):
        return [check_ids(list(p), vocab_size, "prompt")]
    if all(isinstance(x, str) for x in p):
        if len(p) > MAX_PROMPTS:
            raise bad_request(f"At most {MAX_PROMPTS} prompts per request.", param="prompt")
        return list(p)
    if all(isinstance(x, list) for x in p):
        if len(p) > MAX_PROMPTS:
            raise bad_request(f"At most {MAX_PROMPTS} prompts per request.", param="prompt")
        if any(not x for x in p):
            raise bad_request("Token-id prompts must not be empty.", param="prompt")
        return [check_ids(x, vocab_size, "prompt") for x in p]
    raise bad_request("prompt must be a string, a list of strings, a list of token ids, or a list of "
                      "token-id lists.", param="prompt")


@dataclass(frozen=True)
class ChatTemplateCall:
    """The arguments of the engine's ``apply_chat_template`` for one chat request."""

    messages: list[dict]
    add_generation_prompt: bool
    continue_final_message: bool
    template_kwargs: dict

    def args(self) -> tuple:
        return self.messages, self.add_generation_prompt, self.continue_final_message, self.template_kwargs


def chat_template_call(req: s.ChatCompletionRequest, tokenizer, base_model_id: str) -> ChatTemplateCall:
    if getattr(tokenizer, "chat_template", None) is None:
        # a base model often ships none; vLLM refuses chat then too (transformers has no default any more)
        raise bad_request(f"The base model {base_model_id!r} has no chat template, so it cannot render messages; "
                          "send a prompt to /v1/completions instead.", param="messages", code="unsupported")
    if not req.messages:
        raise bad_request("messages must contain at least one message.", param="messages")
    try:
        messages = chat_messages(msgspec.to_builtins(req.messages))
    except ChatMessageError as exc:
        raise bad_request(str(exc), param=exc.param) from None
    add_generation_prompt = req.add_generation_prompt is not False  # vLLM's default: true
    continue_final_message = bool(req.continue_final_message)
    if add_generation_prompt and continue_final_message:
        raise bad_request("continue_final_message (continue the last message) cannot be combined with "
                          "add_generation_prompt (start a new assistant message), which defaults to true: "
                          "send add_generation_prompt=false.", param="continue_final_message")
    extra = template_kwargs(tokenizer, req.chat_template_kwargs)
    return ChatTemplateCall(messages, add_generation_prompt, continue_final_message, extra)


# what rendering a chat template raises for a conversation it refuses
TEMPLATE_ERRORS = (TemplateError, ValueError, TypeError)


def template_refusal(exc: Exception) -> ApiError:
    """The model's chat template refused the conversation (raise_exception: roles must alternate, ...), or
    transformers did (continue_final_message: the last message is not in the rendered text, ...)."""
    return bad_request(f"The model's chat template cannot render these messages: {exc}", param="messages")


def chat_role(req: s.ChatCompletionRequest) -> str:
    """The role of the message generated: vLLM answers a prompt that opens no assistant turn in the last message's
    role."""
    return "assistant" if req.add_generation_prompt is not False else req.messages[-1].role


def truncate_prompts(prompts: list[list[int]], texts: list[str | None], keep_last: int | None, max_model_len: int
                     ) -> tuple[list[list[int]], list[str | None]]:
    """vLLM's ``truncate_prompt_tokens``: each prompt's last tokens only; a prompt cut short has no text to echo."""
    keep = check_truncate_prompt_tokens(keep_last, max_model_len)
    if keep is None:
        return prompts, texts
    return [ids[-keep:] for ids in prompts], [t if len(ids) <= keep else None for ids, t in zip(prompts, texts)]


# ---- budget and sampling --------------------------------------------------------------------------


@dataclass(frozen=True)
class CompletionOutputs:
    """What a completion request asks the engine for beside its prompts."""

    max_tokens: int  # as the request gives it, or the default (the engine runs 1 where prompt_only)
    prompt_only: bool  # echo with max_tokens 0: the prompt alone, nothing generated (prompt scoring)
    score_prompt: bool  # echo + logprobs: the prompt's tokens come with their logprobs (OpenAI)
    logprobs: int | None
    prompt_logprobs: int | None


def completion_outputs(req: s.CompletionRequest) -> CompletionOutputs:
    # echo + logprobs also scores the prompt (OpenAI; lm-eval-harness's loglikelihood requests rely on it)
    score_prompt = bool(req.echo) and req.logprobs is not None
    prompt_logprobs = req.prompt_logprobs
    if prompt_logprobs is None and score_prompt:
        prompt_logprobs = req.logprobs
    max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    prompt_only = bool(req.echo) and max_tokens == 0
    if prompt_only and req.min_tokens:
        raise bad_request(f"min_tokens must be at most max_tokens (0), got {req.min_tokens}.", param="min_tokens")
    return CompletionOutputs(1 if prompt_only else max_tokens, prompt_only, score_prompt,
                             None if prompt_only else req.logprobs, prompt_logprobs)


def chat_max_tokens(req: s.ChatCompletionRequest) -> tuple[int | None, str]:
    """(the requested budget, None for the rest of the context; the field that set it)."""
    if req.max_completion_tokens is not None:
        return req.max_completion_tokens, "max_completion_tokens"
    return req.max_tokens, "max_tokens"


def engine_params(req, prompts: list[list[int]], limits: Limits, vocab_size: int | None, *, max_tokens: int | None,
                  max_tokens_param: str, prompt_param: str, logprobs: int | None,
                  prompt_logprobs: int | None = None) -> SamplingParams:
    """The request's SamplingParams within ``limits``; ``max_tokens`` None: the rest of the context (at most the
    limit), for the shortest prompt. Every value out of bounds is a 400 naming its field."""
    n = check_n(req.n, len(prompts), limits)
    stop = normalize_stop(req.stop, limits)
    if req.stop_token_ids:
        if len(req.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise bad_request(f"At most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed, got "
                              f"{len(req.stop_token_ids)}.", param="stop_token_ids")
        check_ids(req.stop_token_ids, vocab_size, "stop_token_ids")
    budget = min(check_max_tokens(max_tokens, len(ids), limits, max_tokens_param, prompt_param) for ids in prompts)
    check_token_restrictions(req, vocab_size)
    return sampling_params(req, n=n, max_tokens=budget, stop=stop, logprobs=logprobs,
                           prompt_logprobs=prompt_logprobs)


# ---- the engine's answers -------------------------------------------------------------------------


def refusal_text(exc: ValueError, param_names: dict[str, str]) -> tuple[str, str | None]:
    """The engine's refusal of a request (a ValueError from adding it) and the field it names, in the endpoint's
    names (``param_names``: the engine's field -> the endpoint's, prompt -> messages, ...)."""
    param = getattr(exc, "param", None)
    if param is None:
        return str(exc), None
    param = param_names.get(param, param)
    return f"{param}: {getattr(exc, 'detail', exc)}", param


def refused(text: str, param: str | None) -> ApiError:
    """The engine refused the request itself (e.g. prompt + max_tokens need more KV blocks than the cache has)."""
    return ApiError(400, f"The request was refused: {text}", param=param, code="invalid_value")


def engine_failed(text: str) -> ApiError:
    return ApiError(503, f"The inference engine failed: {text}", type="server_error", code="engine_error",
                    headers={"Retry-After": "5"})
