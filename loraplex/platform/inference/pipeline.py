"""From a validated OpenAI request to a running :class:`Generation` (shared by both endpoints)."""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, replace

from litestar import Request

from loraplex.platform.auth import principal_of
from loraplex.platform.errors import ApiError, bad_request, model_not_found
from loraplex.platform.inference import plan
from loraplex.platform.inference import schemas as s
from loraplex.platform.inference.runner import Generation, engine_unavailable, new_response_id
from loraplex.platform.inference.validation import Limits
from loraplex.platform.limits import RequestSize

log = logging.getLogger(__name__)



@dataclass
class Prepared:
    generation: Generation
    headers: dict[str, str]  # x-ratelimit-*
    prompt_texts: list[str | None]  # for echo


async def _tokenize(services, tenant: str, fn, *args) -> list[int]:
    """Every tokenizer call runs on the one tokenizer thread (never on the event loop, never two at once), tenants
    served in turn (``tokenizer_queue``)."""
    return list(await services.tokenizer.run(tenant, fn, *args))


def _vocab_size(engine) -> int | None:
    # the model's embedding rows decide (a checkpoint may have more rows than its tokenizer has tokens)
    vocab = getattr(engine, "vocab_size", None)
    if vocab is None:
        tokenizer = getattr(engine, "tokenizer", None)
        vocab = len(tokenizer) if tokenizer is not None else None
    return vocab


_token_chars: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _max_token_chars(tokenizer) -> int:
    """The most characters one token of ``tokenizer`` stands for (its longest vocabulary entry as written: a byte-level
    BPE piece is one character a byte, a byte-fallback piece ``<0x41>`` six for one byte), computed once."""
    try:
        return _token_chars[tokenizer]
    except (KeyError, TypeError):
        pass
    longest = max(map(len, tokenizer.get_vocab()), default=1)
    with contextlib.suppress(TypeError):
        _token_chars[tokenizer] = longest
    return longest


def check_prompt_chars(services, chars: int, param: str) -> None:
    """A prompt text too long to fit the context whatever its tokens is refused before it is tokenized: every
    request's prompts go through the one tokenizer thread, ahead of the rate limits, so a 10 MB prompt held every
    tenant's requests for seconds (tenants now take turns there: this bounds what one turn can cost). The bound is
    the context times the longest token (times 2, for normalizers that join characters), so no prompt the context
    could hold is refused."""
    engine = services.engine
    tokenizer = getattr(engine, "tokenizer", None)
    max_model_len = getattr(engine, "max_model_len", None)
    if tokenizer is None or not max_model_len:
        return
    limit = max_model_len * _max_token_chars(tokenizer) * 2
    if chars > limit:
        raise bad_request(f"The prompt has {chars} characters, more than this model's maximum context of "
                          f"{max_model_len} tokens can hold (at most {limit} characters, before any "
                          f"truncate_prompt_tokens).", param=param, code="context_length_exceeded")


def _text_chars(value) -> int:
    """Characters of every string in a message list (contents, text parts, names)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(_text_chars(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_text_chars(v) for v in value)
    return 0


async def completion_prompts(req: s.CompletionRequest, services, tenant: str,
                             ) -> tuple[list[list[int]], list[str | None]]:
    """The request's prompts as token ids, and the text of each one given as a string (for echo)."""
    items = plan.completion_prompt_items(req, _vocab_size(services.engine))
    check_prompt_chars(services, sum(len(x) for x in items if isinstance(x, str)), "prompt")
    prompts = [await _tokenize(services, tenant, services.engine.encode, x) if isinstance(x, str) else x
               for x in items]
    return prompts, [x if isinstance(x, str) else None for x in items]


async def echo_texts(services, tenant: str, prompts: list[list[int]], texts: list[str | None]) -> list[str]:
    """The text ``echo`` repeats: a string prompt as sent, a token-id prompt decoded (special tokens
    skipped, so that echoing ``encode(text)`` gives back ``text``)."""
    decode = services.engine.tokenizer.decode
    out = []
    for ids, text in zip(prompts, texts):
        if text is None:
            text = await services.tokenizer.run(tenant, decode, ids, skip_special_tokens=True)
        out.append(text)
    return out


async def first_token_texts(services, tenant: str, prompts: list[list[int]]) -> list[str]:
    """The text of each prompt's first token (``echo`` + ``logprobs``; the engine gives the others')."""
    decode = services.engine.tokenizer.decode
    return [await services.tokenizer.run(tenant, decode, ids[:1]) for ids in prompts]


async def chat_prompt(req: s.ChatCompletionRequest, services, tenant: str) -> list[int]:
    call = plan.chat_template_call(req, services.engine.tokenizer, services.base_model_id)
    check_prompt_chars(services, _text_chars(call.messages), "messages")
    try:
        return await _tokenize(services, tenant, services.engine.apply_chat_template, *call.args())
    except plan.TEMPLATE_ERRORS as exc:
        raise plan.template_refusal(exc) from exc


async def prepare(request: Request, req, endpoint: str, prompts: list[list[int]], texts: list[str | None],
                  resolved, principal, *, max_tokens: int | None, max_tokens_param: str, prompt_param: str,
                  logprobs: int | None, prompt_logprobs: int | None = None, prompt_only: bool = False) -> Prepared:
    services = request.app.state.services
    engine = services.engine
    limits = Limits.from_settings(services.settings, engine.max_model_len)
    params = plan.engine_params(req, prompts, limits, _vocab_size(engine), max_tokens=max_tokens,
                                max_tokens_param=max_tokens_param, prompt_param=prompt_param, logprobs=logprobs,
                                prompt_logprobs=prompt_logprobs)
    budget = params.max_tokens
    prompt_tokens, sequences = sum(len(ids) for ids in prompts), params.n * len(prompts)
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
