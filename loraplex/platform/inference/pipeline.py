"""From a validated OpenAI request to a running :class:`Generation` (shared by both endpoints)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Iterator
from dataclasses import dataclass, replace

import msgspec
from jinja2 import TemplateError
from litestar import Request

from loraplex.engine.chat import ChatMessageError, chat_messages
from loraplex.platform.auth import principal_of
from loraplex.platform.errors import ApiError, bad_request, model_not_found
from loraplex.platform.inference import schemas as s
from loraplex.platform.inference.chat_kwargs import template_kwargs
from loraplex.platform.inference.runner import Generation, engine_unavailable, new_response_id
from loraplex.platform.inference.validation import (
    MAX_PROMPTS,
    MAX_STOP_TOKEN_IDS,
    Limits,
    check_max_tokens,
    check_n,
    check_token_restrictions,
    normalize_stop,
    sampling_params,
)
from loraplex.platform.limits import RequestSize

log = logging.getLogger(__name__)



@dataclass
class Prepared:
    generation: Generation
    headers: dict[str, str]  # x-ratelimit-*
    prompt_texts: list[str | None]  # for echo


async def _tokenize(services, fn, *args) -> list[int]:
    """Every tokenizer call runs on the one tokenizer thread: never on the event loop (a long prompt
    would stall every stream), and never two at once (a fast tokenizer is not safe across threads)."""
    loop = asyncio.get_running_loop()
    return list(await loop.run_in_executor(services.tokenizer_executor, functools.partial(fn, *args)))


def _vocab_size(engine) -> int | None:
    # the model's embedding rows decide (a checkpoint may have more rows than its tokenizer has tokens)
    vocab = getattr(engine, "vocab_size", None)
    if vocab is None:
        tokenizer = getattr(engine, "tokenizer", None)
        vocab = len(tokenizer) if tokenizer is not None else None
    return vocab


def _check_ids(ids: list[int], engine, param: str) -> list[int]:
    vocab = _vocab_size(engine)
    for t in ids:
        if t < 0 or (vocab is not None and t >= vocab):
            raise bad_request(f"Token id {t} is outside the model's vocabulary [0, {vocab}).", param=param)
    return ids


async def completion_prompts(req: s.CompletionRequest, services) -> tuple[list[list[int]], list[str | None]]:
    engine = services.engine
    p = req.prompt
    if isinstance(p, str):
        return [await _tokenize(services, engine.encode, p)], [p]
    if not p:
        raise bad_request("prompt must not be empty.", param="prompt")
    if all(isinstance(x, int) and not isinstance(x, bool) for x in p):
        return [_check_ids(list(p), engine, "prompt")], [None]
    if all(isinstance(x, str) for x in p):
        if len(p) > MAX_PROMPTS:
            raise bad_request(f"At most {MAX_PROMPTS} prompts per request.", param="prompt")
        return [await _tokenize(services, engine.encode, x) for x in p], list(p)
    if all(isinstance(x, list) for x in p):
        if len(p) > MAX_PROMPTS:
            raise bad_request(f"At most {MAX_PROMPTS} prompts per request.", param="prompt")
        if any(not x for x in p):
            raise bad_request("Token-id prompts must not be empty.", param="prompt")
        return [_check_ids(x, engine, "prompt") for x in p], [None] * len(p)
    raise bad_request("prompt must be a string, a list of strings, a list of token ids, or a list of "
                      "token-id lists.", param="prompt")


async def echo_texts(services, prompts: list[list[int]], texts: list[str | None]) -> list[str]:
    """The text ``echo`` repeats: a string prompt as sent, a token-id prompt decoded (special tokens
    skipped, so that echoing ``encode(text)`` gives back ``text``)."""
    decode = services.engine.tokenizer.decode
    out = []
    for ids, text in zip(prompts, texts):
        if text is None:
            loop = asyncio.get_running_loop()
            text = await loop.run_in_executor(services.tokenizer_executor,
                                              functools.partial(decode, ids, skip_special_tokens=True))
        out.append(text)
    return out


async def first_token_texts(services, prompts: list[list[int]]) -> list[str]:
    """The text of each prompt's first token (``echo`` + ``logprobs``; the engine gives the others')."""
    decode = services.engine.tokenizer.decode
    loop = asyncio.get_running_loop()
    return [await loop.run_in_executor(services.tokenizer_executor, decode, ids[:1]) for ids in prompts]


async def chat_prompt(req: s.ChatCompletionRequest, services) -> list[int]:
    if getattr(services.engine.tokenizer, "chat_template", None) is None:
        # a base model often ships none; vLLM refuses chat then too (transformers has no default any more)
        raise bad_request(f"The base model {services.base_model_id!r} has no chat template, so it cannot render messages; "
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
    extra = template_kwargs(services.engine.tokenizer, req.chat_template_kwargs)
    try:
        return await _tokenize(services, services.engine.apply_chat_template, messages, add_generation_prompt,
                               continue_final_message, extra)
    except (TemplateError, ValueError, TypeError) as exc:
        # the model's chat template refused the conversation (raise_exception: roles must alternate, ...), or
        # transformers did (continue_final_message: the last message is not in the rendered text, ...)
        raise bad_request(f"The model's chat template cannot render these messages: {exc}",
                          param="messages") from exc


async def prepare(request: Request, req, endpoint: str, prompts: list[list[int]], texts: list[str | None],
                  resolved, principal, *, max_tokens: int | None, max_tokens_param: str, prompt_param: str,
                  logprobs: int | None, prompt_logprobs: int | None = None, prompt_only: bool = False) -> Prepared:
    services = request.app.state.services
    engine = services.engine
    limits = Limits.from_settings(services.settings, engine.max_model_len)
    n = check_n(req.n, len(prompts), limits)
    stop = normalize_stop(req.stop, limits)
    if req.stop_token_ids:
        if len(req.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise bad_request(f"At most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed, got "
                              f"{len(req.stop_token_ids)}.", param="stop_token_ids")
        _check_ids(req.stop_token_ids, engine, "stop_token_ids")
    budget = min(check_max_tokens(max_tokens, len(ids), limits, max_tokens_param, prompt_param) for ids in prompts)
    check_token_restrictions(req, _vocab_size(engine))
    params = sampling_params(req, n=n, max_tokens=budget, stop=stop, logprobs=logprobs,
                             prompt_logprobs=prompt_logprobs)
    prompt_tokens, sequences = sum(len(ids) for ids in prompts), n * len(prompts)
    size = RequestSize(model=resolved.name, prompt_tokens=prompt_tokens, max_tokens=budget, sequences=sequences,
                       default_budget=max_tokens is None, min_budget=max(1, req.min_tokens or 0),
                       max_tokens_param=max_tokens_param, prompt_param=prompt_param)
    try:  # before anything is taken: a request larger than the tenant's tokens/min limit never runs
        budget = services.limiter.fit(principal, size)
    except ApiError:
        services.metrics.rejected.labels("rate_limit").inc()
        raise
    if budget != params.max_tokens:  # a default budget cut to the limit
        params = replace(params, max_tokens=budget)
    try:
        services.admission.acquire()
    except ApiError:
        services.metrics.rejected.labels("admission").inc()
        raise
    # without max_tokens the budget is the server's default, no promise: the quota may cut it to what it has left
    at_least = prompt_tokens + size.min_budget * sequences if max_tokens is None else None
    async with contextlib.AsyncExitStack() as held:  # given back on any exit, unless the generation takes it
        held.callback(services.admission.release)
        estimate = prompt_tokens + budget * sequences
        try:
            reservation = await services.quota.reserve(principal, estimate, at_least)
        except ApiError:
            services.metrics.rejected.labels("quota").inc()
            raise
        held.callback(services.quota.release, reservation)
        if reservation is not None and reservation.tokens < estimate:
            budget = (reservation.tokens - prompt_tokens) // sequences
            params = replace(params, max_tokens=budget)  # at_least kept it >= 1 and >= min_tokens
            estimate = prompt_tokens + budget * sequences
        try:
            grant = await services.limiter.admit(principal, estimate)
        except ApiError as exc:
            services.metrics.rejected.labels("rate_limit" if exc.status_code == 429 else "other").inc()
            raise
        held.push_async_callback(services.limiter.settle, principal, grant, 0)
        prefix = "chatcmpl" if endpoint == "chat.completions" else "cmpl"
        response_id = new_response_id(prefix)
        if services.settings.log_prompts:  # off by default: prompts are tenants' data
            log.info("prompt %s tenant=%s tokens=%s", response_id, principal.tenant_name, prompts)
        gen = Generation(
            services=services, principal=principal, model=resolved, endpoint=endpoint,
            response_id=response_id, prompts=prompts, params=params, grant=grant,
            quota_reservation=reservation, param_names={"prompt": prompt_param, "max_tokens": max_tokens_param},
            streamed=bool(getattr(req, "stream", False)), prompt_only=prompt_only,
        )
        held.pop_all()  # Generation.close() gives them back from here on
    return Prepared(gen, grant.headers, texts)


@contextlib.contextmanager
def owned(gen: Generation) -> Iterator[Generation]:
    """The route holds ``gen`` (its slot, tokens, quota and engine requests) until a response takes it over:
    any exception or cancellation in between closes it (abort, usage, release; a no-op once closed)."""
    try:
        yield gen
    except BaseException:
        gen.close()
        raise


async def authorize_and_resolve(request: Request, model: str):
    """Principal, engine readiness, and the model (one 404 for missing and foreign)."""
    services = request.app.state.services
    principal = await principal_of(request)
    resolved = await services.models.resolve(principal, model)
    if resolved is None:
        raise model_not_found(model)
    err = engine_unavailable(services)
    if err is not None:
        services.metrics.rejected.labels("engine_unavailable").inc()
        raise err
    return principal, resolved


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client goes away (the request body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
