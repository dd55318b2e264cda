"""One HTTP inference request's engine work: admission, rate limits, engine requests, accounting.

:class:`Generation` turns prepared prompts into a merged stream of per-choice deltas. Whatever ends
it (completion, client disconnect, engine failure) its ``close`` aborts unfinished engine requests
and records usage exactly once, on a task of its own so a cancelled HTTP task cannot skip it.

Billed: the prompt tokens the engine ran (an aborted request's final delta says how many: none while it
waited in the engine's queue, the chunks that ran of a prefill) and the completion tokens delivered.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from loraplex.engine.protocol import EngineDeadError, EngineRequest, TokenDelta
from loraplex.engine.sampling_params import SamplingParams
from loraplex.platform.auth import Principal
from loraplex.platform.errors import ApiError
from loraplex.platform.hooks import STATUS_ABORTED, STATUS_COMPLETED, STATUS_ERROR, ResolvedModel, UsageEvent
from loraplex.platform.inference.plan import refusal_text
from loraplex.platform.limits import RateGrant
from loraplex.platform.services import Services

log = logging.getLogger(__name__)

# how often a waiting stream re-checks that the engine is alive (a dead engine never hangs a stream)
ENGINE_HEALTH_POLL_S = 0.5
# how long the usage record waits for an aborted request's final delta (the next engine step brings it)
ABORT_REPORT_WAIT_S = 5.0


class EngineFailure(Exception):
    """The engine failed or refused the request (a stream ends with an error event).

    ``invalid``: the engine refused the request itself (a ValueError from ``add_requests``), a 400;
    ``param``: the field it names, when the engine's error says (``SamplingParamsError.param``), as the
    endpoint calls it; ``draining``: the server ended it because its drain timeout passed (a 503 ``draining``)."""

    def __init__(self, message: str, invalid: bool = False, param: str | None = None, draining: bool = False):
        super().__init__(message)
        self.invalid = invalid
        self.param = param
        self.draining = draining


def new_response_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass
class ChoiceDelta:
    index: int  # global choice index: prompt_index * n + sample index
    delta: TokenDelta


@dataclass
class _PromptState:
    request_id: str
    num_prompt_tokens: int = 0  # that the engine ran, as its deltas say
    num_cached_tokens: int = 0
    finished_samples: int = 0
    done: bool = False


@dataclass
class Generation:
    services: Services
    principal: Principal
    model: ResolvedModel
    endpoint: str
    response_id: str
    prompts: list[list[int]]
    params: SamplingParams
    grant: RateGrant
    quota_reservation: object | None = None  # from services.quota; released once usage is recorded
    # the engine's names of request fields -> this endpoint's (prompt -> messages, max_tokens -> ...)
    param_names: dict[str, str] = field(default_factory=dict)
    arrival: float = field(default_factory=time.monotonic)
    # a stream delivers each delta as it comes; a JSON response delivers nothing unless it completes (a request
    # that ends in an error response is billed no completion tokens)
    streamed: bool = True
    # the prompt alone (completions' echo with max_tokens 0, to score it): the engine samples after every prompt,
    # so each choice runs with max_tokens 1 and its token (sampled in the prompt's own step, no extra forward
    # pass) is neither sent nor billed; the choice ends "length", as in OpenAI's and vLLM's answer
    prompt_only: bool = False
    completion_tokens: int = 0  # delivered to the client
    status: str = STATUS_COMPLETED
    finish_reasons: list[str] = field(default_factory=list)
    first_scheduled: float | None = None
    first_token: float | None = None
    _last_token: float | None = None
    _states: list[_PromptState] = field(default_factory=list)
    _closed: bool = False
    _streams: list | None = None  # the engine's DeltaStream per prompt, once admitted
    _finish_task: asyncio.Task | None = None
    # stream(): the tasks that read each engine stream into one queue, and that queue
    _pumps: list[asyncio.Task] = field(default_factory=list)
    _merged: asyncio.Queue | None = None

    @property
    def prompt_tokens(self) -> int:
        return sum(s.num_prompt_tokens for s in self._states)

    @property
    def cached_tokens(self) -> int:
        return sum(s.num_cached_tokens for s in self._states)

    def _engine_requests(self) -> list[EngineRequest]:
        salt = self.services.cache_salt(self.principal.tenant_id)
        reqs = []
        for i, ids in enumerate(self.prompts):
            rid = self.response_id if len(self.prompts) == 1 else f"{self.response_id}-{i}"
            self._states.append(_PromptState(rid))
            reqs.append(EngineRequest(
                request_id=rid, prompt_token_ids=ids, sampling_params=self.params,
                lora_request=self.model.lora_request, tenant_id=self.principal.tenant_id, cache_salt=salt,
                arrival_time=self.arrival,
            ))
        return reqs

    async def start(self) -> None:
        """Have the engine admit every prompt, all or none, before a response starts: a refusal raises
        :class:`EngineFailure` (``invalid``, naming this endpoint's field) and leaves nothing running and
        nothing billed."""
        if self._streams is not None:
            return
        reqs = self._engine_requests()
        try:
            self._streams = await self._admit(reqs)
        except (ValueError, EngineDeadError, EngineFailure) as exc:  # nothing runs in the engine
            self._states.clear()
            self.status = STATUS_ERROR
            self.close()
            if isinstance(exc, EngineFailure):
                raise
            if isinstance(exc, EngineDeadError):
                raise EngineFailure(str(exc)) from exc
            raise self._refusal(exc) from exc
        except BaseException:  # cancelled: the engine may still admit them, close() aborts them by id
            self.status = STATUS_ABORTED
            self.close()
            raise

    async def _admit(self, reqs: list[EngineRequest]) -> list:
        """``engine.add_requests``, given up (and its requests aborted) when the drain timeout passes before the
        engine answers: an engine stuck before it admits them must not hold the response past the drain."""
        adding = asyncio.ensure_future(self.services.engine.add_requests(reqs))
        try:
            while not (await asyncio.wait({adding}, timeout=ENGINE_HEALTH_POLL_S))[0]:
                if self.services.drain_expired:
                    adding.cancel()  # add_requests aborts what the engine may still admit
                    await asyncio.wait({adding})
                    self._check_drain()
        except BaseException:
            adding.cancel()
            raise
        return adding.result()

    def _refusal(self, exc: ValueError) -> EngineFailure:
        text, param = refusal_text(exc, self.param_names)
        return EngineFailure(text, invalid=True, param=param)

    async def stream(self) -> AsyncIterator[ChoiceDelta]:
        """Merged deltas of every prompt's samples. Raises :class:`EngineFailure` if the engine refuses
        (when not started yet) or fails."""
        engine = self.services.engine
        queue: asyncio.Queue = asyncio.Queue()
        self._merged = queue
        await self.start()
        streams = self._streams

        async def pump(i: int, deltas) -> None:
            try:
                async for delta in deltas:
                    await queue.put((i, delta))
            except Exception as exc:  # EngineDeadError or a bug: surfaced to the stream, not swallowed
                await queue.put((i, exc))
            finally:
                deltas.close()
                await queue.put((i, None))

        tasks = [asyncio.create_task(pump(i, r), name=f"gen:{r.request_id}") for i, r in enumerate(streams)]
        self._pumps = tasks
        open_prompts = len(streams)
        try:
            while open_prompts:
                self._check_drain()
                try:
                    i, item = await asyncio.wait_for(queue.get(), ENGINE_HEALTH_POLL_S)
                except asyncio.TimeoutError:
                    if not engine.is_healthy():
                        raise EngineFailure("the engine stopped") from None
                    continue
                if item is None:
                    open_prompts -= 1
                    self._states[i].done = True
                    continue
                if isinstance(item, Exception):
                    if not isinstance(item, EngineDeadError):
                        log.error("engine stream failed for %s", streams[i].request_id, exc_info=item)
                    raise EngineFailure(str(item) or type(item).__name__)
                if item.finish_reason == "error" or item.error:
                    raise EngineFailure(item.error or "engine error")
                if self.prompt_only:
                    item = _without_output(item)
                self._observe(i, item)
                yield ChoiceDelta(i * self.params.n + item.index, item)
                self.completion_tokens += len(item.token_ids)
        except EngineFailure:
            self.status = STATUS_ERROR
            if not self.streamed:  # the client gets an error response, none of the tokens
                self.completion_tokens = 0
            raise
        except (asyncio.CancelledError, GeneratorExit):
            self.status = STATUS_ABORTED
            raise
        finally:
            for t in tasks:
                t.cancel()
            if any(not s.done for s in self._states) and self.status == STATUS_COMPLETED:
                self.status = STATUS_ABORTED
            self.close()

    def _check_drain(self) -> None:
        if self.services.drain_expired:
            raise EngineFailure("the server's drain timeout passed before this request finished", draining=True)

    def _count_prompt(self, i: int, d: TokenDelta) -> None:
        state = self._states[i]
        state.num_prompt_tokens = max(state.num_prompt_tokens, d.num_computed_prompt_tokens)
        state.num_cached_tokens = max(state.num_cached_tokens, d.num_cached_tokens)

    def _observe(self, i: int, d: TokenDelta) -> None:
        self._count_prompt(i, d)
        state = self._states[i]
        now = time.monotonic()
        if d.first_scheduled_time and self.first_scheduled is None:
            self.first_scheduled = d.first_scheduled_time
        if d.token_ids:
            metrics, model = self.services.metrics, self.services.base_model_id
            if self.first_token is None:
                self.first_token = now
                metrics.ttft.labels(model).observe(now - self.arrival)
            elif self._last_token is not None:
                metrics.itl.labels(model).observe((now - self._last_token) / len(d.token_ids))
            self._last_token = now
        if d.finished:
            state.finished_samples += 1
            if d.finish_reason:
                self.finish_reasons.append(d.finish_reason)

    def close(self) -> None:
        """Abort what is still running and record usage, once (safe to call from a cancelled task)."""
        if self._closed:
            return
        self._closed = True
        if not self._states:  # never reached the engine: no usage, give back the reservation
            self.services.spawn(self._release_unstarted(), name=f"release:{self.response_id}")
            return
        unfinished = [s.request_id for s in self._states if not s.done]
        if unfinished and self.status == STATUS_COMPLETED:  # closed by a disconnect before the stream ended
            self.status = STATUS_ABORTED
        self._finish_task = self.services.spawn(self._finish(unfinished), name=f"finish:{self.response_id}")

    async def wait_recorded(self) -> None:
        """Wait until the usage event is in the sink (durable), so a client never sees the end of a
        response whose usage a crash could still lose."""
        if self._finish_task is not None:
            await asyncio.shield(self._finish_task)

    async def _release_unstarted(self) -> None:
        try:
            await self.services.limiter.settle(self.principal, self.grant, 0)
        finally:
            self.services.quota.release(self.quota_reservation)
            self.services.admission.release()

    async def _finish(self, unfinished: list[str]) -> None:
        s = self.services
        try:
            await self._account(unfinished)
        finally:  # whatever failed above (or a cancellation), the slot and the reservation come back
            s.quota.release(self.quota_reservation)
            s.admission.release()

    async def _read_abort_reports(self) -> None:
        """The final deltas of the aborted engine requests: how much of each prompt ran. A request cancelled
        before the engine took it has no stream, and nothing of it is billed (at most one step of it ran)."""
        if self._streams is None:
            return
        # one reader per engine stream: the pumps of stream() stop first. A pump may already have taken a final
        # delta (it reads until cancelled, and a disconnect can close the generation before its stream()'s own
        # cleanup runs); what it took and nobody read is in the merged queue. Reading both at once lost that
        # delta, and the wait below then ran to its timeout.
        for task in self._pumps:
            task.cancel()
        if self._pumps:
            await asyncio.gather(*self._pumps, return_exceptions=True)
        while self._merged is not None and not self._merged.empty():
            i, item = self._merged.get_nowait()
            if isinstance(item, TokenDelta):
                self._count_prompt(i, item)
        aborted = [i for i, state in enumerate(self._states) if not state.done and not self._streams[i].done]
        try:
            reports = await asyncio.gather(*(self._streams[i].drain(ABORT_REPORT_WAIT_S) for i in aborted))
        except Exception:
            log.warning("abort reports of %s failed", self.response_id, exc_info=True)
            return
        for i, deltas in zip(aborted, reports):
            if not any(d.finished for d in deltas):
                log.warning("abort report of %s not received within %.0f s: billed as far as seen",
                            self._states[i].request_id, ABORT_REPORT_WAIT_S)
            for d in deltas:
                self._count_prompt(i, d)

    async def _account(self, unfinished: list[str]) -> None:
        """Abort what still runs, then metrics, the limiter's settlement and the usage record."""
        s = self.services
        for rid in unfinished:
            try:
                await s.engine.abort(rid)
            except Exception:
                log.warning("abort of %s failed", rid, exc_info=True)
        await self._read_abort_reports()
        end = time.monotonic()
        tenant = self.principal.tenant_name
        model = s.base_model_id
        try:  # a metrics failure must not cost the usage record
            s.metrics.prompt_tokens.labels(model).inc(self.prompt_tokens)
            s.metrics.generation_tokens.labels(model).inc(self.completion_tokens)
            s.metrics.e2e.labels(model).observe(end - self.arrival)
            reason = self.status if self.status != STATUS_COMPLETED else (self.finish_reasons or ["stop"])[-1]
            s.metrics.request_success.labels(model, reason).inc()
            s.metrics.tenant_requests.labels(tenant, self.status).inc()
            s.metrics.tenant_tokens.labels(tenant, "prompt").inc(self.prompt_tokens)
            s.metrics.tenant_tokens.labels(tenant, "cached").inc(self.cached_tokens)
            s.metrics.tenant_tokens.labels(tenant, "completion").inc(self.completion_tokens)
        except Exception:
            log.warning("metrics update failed for %s", self.response_id, exc_info=True)
        try:
            await s.limiter.settle(self.principal, self.grant, self.prompt_tokens + self.completion_tokens)
        except Exception:
            log.warning("rate-limit settlement failed for %s", self.response_id, exc_info=True)
        m = self.model
        event = UsageEvent(
            request_id=self.response_id, tenant_id=self.principal.tenant_id, tenant_name=tenant,
            key_id=self.principal.key_id, model=m.name, endpoint=self.endpoint,
            prompt_tokens=self.prompt_tokens, cached_prompt_tokens=self.cached_tokens,
            completion_tokens=self.completion_tokens, status=self.status, adapter_id=m.adapter_id,
            adapter_version=m.adapter_version, adapter_name=m.adapter_name,
            queue_s=None if self.first_scheduled is None else max(0.0, self.first_scheduled - self.arrival),
            ttft_s=None if self.first_token is None else self.first_token - self.arrival,
            total_s=end - self.arrival, finish_reason=(self.finish_reasons or [None])[-1],
        )
        try:
            await s.usage.record(event)
        except Exception:
            log.exception("usage sink failed for %s", self.response_id)


def _without_output(d: TokenDelta) -> TokenDelta:
    """``d`` less what its sample generated (``Generation.prompt_only``): its prompt logprobs and counts stay."""
    ended = d.finish_reason in ("stop", "length")  # an abort stays one
    return dataclasses.replace(d, token_ids=[], text="", logprobs=None, num_generated_tokens=0,
                               cumulative_logprob=None, stop_reason=None,
                               finish_reason="length" if ended else d.finish_reason)


def engine_unavailable(services) -> ApiError | None:
    from loraplex.platform.errors import overloaded

    if services.engine is None:
        return overloaded("The model is still loading; retry shortly.", 2)
    if not services.engine.is_healthy():
        return ApiError(503, "The inference engine is not running.", type="server_error", code="engine_unavailable",
                        headers={"Retry-After": "5"})
    return None
