"""``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` (OpenAI-compatible, SSE streaming)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from litestar import Request, Response, get, post
from litestar.openapi.datastructures import ResponseSpec

from loraplex.platform import idempotency
from loraplex.platform.auth import principal_of, require_scope
from loraplex.platform.errors import (
    ApiError,
    ErrorBody,
    ErrorResponse,
    error_responses,
    model_not_found,
)
from loraplex.platform.hooks import ResolvedModel
from loraplex.platform.inference import plan, render
from loraplex.platform.inference import schemas as s
from loraplex.platform.inference.pipeline import (
    Prepared,
    authorize_and_resolve,
    chat_prompt,
    completion_prompts,
    echo_texts,
    first_token_texts,
    owned,
    prepare,
    wait_for_disconnect,
)
from loraplex.platform.inference.runner import EngineFailure
from loraplex.platform.inference.sse import DONE, SSEStream, StreamingOperation, sse_event
from loraplex.platform.inference.validation import require_model
from loraplex.platform.models import SCOPE_INFERENCE

_ERRORS = error_responses(400, 401, 403, 404, 409, 422, 429, 503)
_INFER = [require_scope(SCOPE_INFERENCE)]


def _model_out(m: ResolvedModel) -> s.Model:
    return s.Model(id=m.name, created=m.created, owned_by=m.owned_by, root=m.parent or m.name, parent=m.parent)


@get("/v1/models", guards=_INFER, responses=error_responses(401, 403), tags=["openai"], summary="List models")
async def list_models(request: Request) -> s.ModelList:
    """The base model and the adapters this tenant may use."""
    principal = await principal_of(request)
    models = await request.app.state.services.models.list_models(principal)
    return s.ModelList(data=[_model_out(m) for m in models])


@get("/v1/models/{model:path}", guards=_INFER, responses=error_responses(401, 403, 404), tags=["openai"],
     summary="Retrieve a model")
async def get_model(request: Request, model: str) -> s.Model:
    model = model.lstrip("/")  # a path parameter, so ids like "<tenant>/<adapter>" work
    principal = await principal_of(request)
    resolved = await request.app.state.services.models.resolve(principal, model)
    if resolved is None:
        raise model_not_found(model)
    return _model_out(resolved)


def _engine_failure_error(exc: EngineFailure) -> ApiError:
    if exc.invalid:  # e.g. prompt + max_tokens need more KV blocks than the replica's cache has
        return plan.refused(str(exc), exc.param)
    if exc.draining:  # the same code as a request refused while draining: retry on another replica
        return ApiError(503, f"Server is shutting down: {exc}; retry on another replica.", type="server_error",
                        code="draining", headers={"Retry-After": "1"})
    return plan.engine_failed(str(exc))


async def _start(prep: Prepared) -> None:
    """The engine admits the request before the response starts: a refusal is the same 400 for a stream."""
    try:
        await prep.generation.start()
    except EngineFailure as exc:
        raise _engine_failure_error(exc) from exc


def _error_event(exc: EngineFailure) -> bytes:
    err = _engine_failure_error(exc)
    return sse_event(ErrorResponse(ErrorBody(message=err.message, type=err.type, param=err.param, code=err.code)))


async def _collect(request: Request, prep: Prepared, on_delta) -> None:
    """Run to completion; a client that disconnects has its engine requests aborted at once."""

    async def consume() -> None:
        async for cd in prep.generation.stream():
            on_delta(cd)

    work = asyncio.ensure_future(consume())
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()
            prep.generation.close()
    # cancel() only requests cancellation: the task is not done yet, and result() would raise
    if not work.done() or work.cancelled():
        raise ApiError(499, "client disconnected", code="client_closed_request")
    try:
        work.result()
    except EngineFailure as exc:
        raise _engine_failure_error(exc) from exc


def _usage(gen) -> s.Usage:
    return render.usage(gen.prompt_tokens, gen.completion_tokens, gen.cached_tokens)


# ---- completions ----------------------------------------------------------------------------------


@post("/v1/completions", guards=_INFER, status_code=200, tags=["openai"], summary="Create a completion",
      operation_class=StreamingOperation,
      responses={**_ERRORS, 200: ResponseSpec(data_container=s.CompletionResponse, description="A completion, "
                 "or with stream=true a text/event-stream of CompletionChunk events ending in [DONE]")})
async def create_completion(request: Request, data: s.CompletionRequest,
                            idempotency_key: str | None = idempotency.KEY_PARAMETER) -> Response[s.CompletionResponse]:
    return await idempotency.json_route(request, idempotency_key, "completions", bool(data.stream),
                                        lambda: _create_completion(request, data))


async def _create_completion(request: Request, data: s.CompletionRequest) -> Response[s.CompletionResponse]:
    require_model(data.model)
    principal, resolved = await authorize_and_resolve(request, data.model)
    services = request.app.state.services
    engine = services.engine
    plan.check_completion(data)
    prompts, texts = await completion_prompts(data, services, principal.tenant_id)
    prompts, texts = plan.truncate_prompts(prompts, texts, data.truncate_prompt_tokens, engine.max_model_len)
    outputs = plan.completion_outputs(data)
    score_prompt = outputs.score_prompt
    prep = await prepare(request, data, "completions", prompts, texts, resolved, principal,
                         max_tokens=outputs.max_tokens, max_tokens_param="max_tokens", prompt_param="prompt",
                         logprobs=outputs.logprobs, prompt_logprobs=outputs.prompt_logprobs,
                         prompt_only=outputs.prompt_only)
    with owned(prep.generation) as gen:  # until the response takes it over
        n = gen.params.n
        created = int(time.time())
        echo = None
        if data.echo:
            prompt_texts = await echo_texts(services, principal.tenant_id, prompts, texts)
            first_tokens = await first_token_texts(services, principal.tenant_id, prompts) if score_prompt else None
            echo = _Echo(engine, prompts, prompt_texts, first_tokens, n)
        await _start(prep)
        if data.stream:
            include_usage = bool(data.stream_options and data.stream_options.include_usage)
            return SSEStream(_completion_events(prep, resolved, created, echo, include_usage, engine),
                             on_close=gen.close, headers=prep.headers)
        choices = [render.ChoiceAccumulator() for _ in range(n * len(prompts))]

        def on_delta(cd) -> None:
            acc = choices[cd.index]
            if echo is not None and not acc.text:  # the choice's first delta
                text, lp, offset = echo.head(cd.index, cd.delta)
                acc.add_text(text)
                acc.offset = offset
                if lp is not None:
                    acc.logprobs.append(lp)
            acc.add_completion_delta(engine, cd.delta)
            if cd.delta.prompt_logprobs is not None and data.prompt_logprobs is not None:
                acc.prompt_logprobs = render.vllm_prompt_logprobs(prompts[cd.index // n], cd.delta.prompt_logprobs)

        await _collect(request, prep, on_delta)
        await gen.wait_recorded()
        body = s.CompletionResponse(id=gen.response_id, created=created, model=resolved.name, usage=_usage(gen),
                                    choices=render.completion_choices(choices))
        return Response(body, headers=prep.headers)


class _Echo:
    """What ``echo`` puts before a choice's first generated text: the prompt, and with ``logprobs`` its
    tokens' logprobs (from the engine's first delta of that choice)."""

    def __init__(self, engine, prompts: list[list[int]], texts: list[str], first_tokens: list[str] | None, n: int):
        self.engine, self.prompts, self.texts, self.first_tokens, self.n = engine, prompts, texts, first_tokens, n

    def head(self, index: int, delta) -> tuple[str, s.CompletionLogprobs | None, int]:
        """(text, logprobs, text offset of the first generated token). With logprobs, offsets run on over
        the prompt's token texts, as vLLM's do (they include special tokens the echoed text skips)."""
        p = index // self.n
        text = self.texts[p]
        if self.first_tokens is None or delta.prompt_logprobs is None:
            return text, None, len(text)
        lp = render.prompt_logprobs(self.engine, self.first_tokens[p], self.prompts[p], delta.prompt_logprobs)
        return text, lp, render.end_offset(lp, 0)


async def _completion_events(prep: Prepared, resolved, created: int, echo: _Echo | None, include_usage: bool,
                             engine) -> AsyncIterator[bytes]:
    gen = prep.generation
    num_choices = gen.params.n * len(gen.prompts)
    offsets = [0] * num_choices
    echoed = [echo is None] * num_choices

    def chunk(choices, usage=None) -> bytes:
        return sse_event(s.CompletionChunk(id=gen.response_id, created=created, model=resolved.name,
                                           choices=choices, usage=usage))

    try:
        async for cd in gen.stream():
            d, i = cd.delta, cd.index
            text, head_lp = "", None
            if not echoed[i]:  # the prompt goes out with the choice's first delta (its logprobs come with it)
                echoed[i] = True
                text, head_lp, offsets[i] = echo.head(i, d)
            generated_lp = render.completion_logprobs(engine, d, offsets[i])
            offsets[i] = render.end_offset(generated_lp, offsets[i])
            lp = render.concat_logprobs([head_lp, generated_lp])
            text += d.text
            if text or d.finished or lp is not None:
                yield chunk([s.CompletionChoice(index=i, text=text, logprobs=lp,
                                                finish_reason=render.finish_reason(d.finish_reason),
                                                stop_reason=d.stop_reason)])
    except EngineFailure as exc:
        yield _error_event(exc)
        return
    await gen.wait_recorded()
    if include_usage:
        yield chunk([], _usage(gen))
    yield DONE


# ---- chat -----------------------------------------------------------------------------------------


@post("/v1/chat/completions", guards=_INFER, status_code=200, tags=["openai"], summary="Create a chat completion",
      operation_class=StreamingOperation,
      responses={**_ERRORS, 200: ResponseSpec(data_container=s.ChatCompletionResponse, description="A chat "
                 "completion, or with stream=true a text/event-stream of ChatCompletionChunk events ending in [DONE]")})
async def create_chat_completion(request: Request, data: s.ChatCompletionRequest,
                                 idempotency_key: str | None = idempotency.KEY_PARAMETER,
                                 ) -> Response[s.ChatCompletionResponse]:
    return await idempotency.json_route(request, idempotency_key, "chat.completions", bool(data.stream),
                                        lambda: _create_chat_completion(request, data))


async def _create_chat_completion(request: Request, data: s.ChatCompletionRequest,
                                  ) -> Response[s.ChatCompletionResponse]:
    require_model(data.model)
    principal, resolved = await authorize_and_resolve(request, data.model)
    engine = request.app.state.services.engine
    top_n = plan.check_chat(data)
    prompt = await chat_prompt(data, request.app.state.services, principal.tenant_id)
    [prompt], _ = plan.truncate_prompts([prompt], [None], data.truncate_prompt_tokens, engine.max_model_len)
    role = plan.chat_role(data)
    max_tokens, param = plan.chat_max_tokens(data)
    prep = await prepare(request, data, "chat.completions", [prompt], [None], resolved, principal,
                         max_tokens=max_tokens, max_tokens_param=param, prompt_param="messages",
                         logprobs=top_n if data.logprobs else None, prompt_logprobs=data.prompt_logprobs)
    with owned(prep.generation) as gen:  # until the response takes it over
        created = int(time.time())
        await _start(prep)
        if data.stream:
            include_usage = bool(data.stream_options and data.stream_options.include_usage)
            return SSEStream(_chat_events(prep, resolved, created, include_usage, engine, top_n, role),
                             on_close=gen.close, headers=prep.headers)
        choices = [render.ChoiceAccumulator() for _ in range(gen.params.n)]

        def on_delta(cd) -> None:
            acc = choices[cd.index]
            acc.add_chat_delta(engine, cd.delta, top_n)
            if cd.delta.prompt_logprobs is not None:
                acc.prompt_logprobs = render.vllm_prompt_logprobs(prompt, cd.delta.prompt_logprobs)

        await _collect(request, prep, on_delta)
        await gen.wait_recorded()
        body = s.ChatCompletionResponse(id=gen.response_id, created=created, model=resolved.name, usage=_usage(gen),
                                        choices=render.chat_choices(choices, role, bool(data.logprobs)),
                                        prompt_logprobs=choices[0].prompt_logprobs)
        return Response(body, headers=prep.headers)


async def _chat_events(prep: Prepared, resolved, created: int, include_usage: bool, engine,
                       top_n: int, role: str) -> AsyncIterator[bytes]:
    gen = prep.generation

    def chunk(choices, usage=None) -> bytes:
        return sse_event(s.ChatCompletionChunk(id=gen.response_id, created=created, model=resolved.name,
                                               choices=choices, usage=usage))

    for i in range(gen.params.n):
        yield chunk([s.ChatChunkChoice(index=i, delta=s.ChatDelta(role=role, content=""))])
    try:
        async for cd in gen.stream():
            d = cd.delta
            lp = render.chat_logprobs(engine, d, top_n)
            if d.text or d.finished or lp is not None:
                yield chunk([s.ChatChunkChoice(index=cd.index, delta=s.ChatDelta(content=d.text or None),
                                               logprobs=lp, finish_reason=render.finish_reason(d.finish_reason),
                                               stop_reason=d.stop_reason)])
    except EngineFailure as exc:
        yield _error_event(exc)
        return
    await gen.wait_recorded()
    if include_usage:
        yield chunk([], _usage(gen))
    yield DONE


def route_handlers() -> list:
    return [list_models, get_model, create_completion, create_chat_completion]
