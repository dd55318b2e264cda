"""Every inference request gives back what it took (admission slot, rate-limit tokens, quota reservation,
idempotency claim, engine requests) on every path: refusals, failures, cancellations and disconnects at
each await point. The app runs in-process on Postgres + Redis with the tiny model on the CPU; requests are
driven through its ASGI interface so a test decides exactly when the client goes away."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import uuid

import httpx
import pytest
import pytest_asyncio
from sqlalchemy import select

from loraplex.platform.app import create_app
from loraplex.platform.usage.models import UsageRecord
from loraplex.settings import Settings
from tests.e2e.server import FreshPostgres
from tests.integration.usage_app import AppAccess

pytestmark = pytest.mark.asyncio(loop_scope="module")

CAP = 2  # admission cap: a leak of CAP slots refuses every later request
TPM = 600  # tokens per minute: a leaked reservation of ~200 tokens shows against it
QUOTA = 100_000
MAX_NUM_SEQS = 4


@pytest.fixture(scope="module")
def database_url(postgres_url):
    with FreshPostgres(postgres_url) as url:
        yield url


class App(AppAccess):
    def __init__(self, app, admin_key: str):
        self.app, self.admin_key = app, admin_key
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=60)


@contextlib.asynccontextmanager
async def running(app):
    """The app's lifespan on this test's event loop (the engine's deltas and the DB pool live on it)."""
    inbox: asyncio.Queue = asyncio.Queue()
    outbox: asyncio.Queue = asyncio.Queue()
    task = asyncio.create_task(app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, inbox.get, outbox.put))
    await inbox.put({"type": "lifespan.startup"})
    assert (await outbox.get())["type"] == "lifespan.startup.complete"
    try:
        yield
    finally:
        await inbox.put({"type": "lifespan.shutdown"})
        await outbox.get()
        await task


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def app(tmp_path_factory, tiny_model, database_url, redis_url):
    keys: list[str] = []
    settings = Settings(data_dir=str(tmp_path_factory.mktemp("release")), model=tiny_model["model_dir"],
                        database_url=database_url, redis_url=redis_url, device="cpu", log_level="WARNING",
                        num_kv_blocks=64, max_num_seqs=MAX_NUM_SEQS, max_concurrent_requests=CAP,
                        default_tokens_per_minute=TPM,
                        # the loop in a thread: these tests read the engine's own request table
                        engine_process=False,
                        server_secret="release-" + uuid.uuid4().hex)
    asgi = create_app(settings, on_bootstrap_key=keys.append)
    async with running(asgi):
        a = App(asgi, keys[0])
        for _ in range(1200):
            if (await a.client.get("/ready")).status_code == 200:
                break
            await asyncio.sleep(0.1)
        assert a.services.base_model_id == MODEL
        yield a
        await a.client.aclose()


@pytest_asyncio.fixture(loop_scope="module")
async def tenant(app):
    name = f"rel-{uuid.uuid4().hex[:8]}"
    r = await app.client.post("/admin/tenants", json={"name": name}, headers=app.headers())
    assert r.status_code == 201, r.text
    t = {"id": r.json()["id"], "name": name}
    r = await app.client.post("/admin/keys", json={"tenant": name}, headers=app.headers())
    t["key"] = r.json()["key"]
    r = await app.client.put(f"/admin/tenant-plans/{name}", json={"monthly_token_quota": QUOTA},
                             headers=app.headers())
    assert r.status_code == 200, r.text
    return t


class Call:
    """One HTTP request straight into the ASGI app; ``leave()`` is the client disconnecting."""

    def __init__(self, app, key: str, path: str, body: dict, headers: dict | None = None,
                 send_fails_when_gone: bool = False, leave_after_chunks: int | None = None):
        self.app, self.path = app, path
        self.raw = json.dumps(body).encode()
        self.headers = [(b"host", b"test"), (b"content-type", b"application/json"),
                        (b"authorization", f"Bearer {key}".encode()), (b"content-length", str(len(self.raw)).encode())]
        self.headers += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
        self.gone = asyncio.Event()
        self.send_fails_when_gone = send_fails_when_gone  # ASGI 2.4 lets a server raise OSError then
        self.messages: list[dict] = []
        self.leave_after_chunks = leave_after_chunks
        self.started = asyncio.Event()
        self._body_read = False

    async def _receive(self) -> dict:
        if not self._body_read:
            self._body_read = True
            return {"type": "http.request", "body": self.raw, "more_body": False}
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def _send(self, message: dict) -> None:
        if self.gone.is_set() and self.send_fails_when_gone:
            raise OSError("client disconnected")
        self.messages.append(message)
        if message["type"] == "http.response.start":
            self.started.set()
        chunks = sum(1 for m in self.messages if m.get("body"))
        if self.leave_after_chunks is not None and chunks >= self.leave_after_chunks:
            self.leave()

    def leave(self) -> None:
        self.gone.set()

    async def run(self) -> None:
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": self.path, "raw_path": self.path.encode(),
                 "query_string": b"", "root_path": "", "headers": self.headers, "client": ("127.0.0.1", 1),
                 "server": ("test", 80), "state": {}}
        await self.app(scope, self._receive, self._send)

    @property
    def status(self) -> int | None:
        return next((m["status"] for m in self.messages if m["type"] == "http.response.start"), None)

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.messages if m["type"] == "http.response.body")


MODEL = "tiny-llama0"  # the tiny model directory's name


def body(stream: bool = False, **kw) -> dict:
    return {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 180, "temperature": 0.0,
            "stream": stream, **kw}


class Blocked:
    """Holds the one tokenizer thread, so the next tokenizer call in a request waits right there."""

    def __init__(self, services):
        self.release_ = threading.Event()
        self.entered = threading.Event()
        self.queue = services.tokenizer
        self.task = asyncio.ensure_future(self.queue.run("another-tenant", self._hold))

    def _hold(self) -> None:
        self.entered.set()
        self.release_.wait(30)

    def release(self) -> None:
        self.release_.set()

    async def waited_on(self) -> None:
        """Returns once a request's tokenizer call queues up behind the held thread."""
        for _ in range(500):
            if self.queue.waiting():
                return
            await asyncio.sleep(0.01)
        raise AssertionError("no tokenizer call came")


async def settled(app) -> None:
    """Background work of finished requests (aborts, usage records) has run, the ledger has it."""
    services = app.services
    for _ in range(200):
        await services.wait_background()
        if not services.background and not services.engine.engine.has_unfinished_requests():
            break
        await asyncio.sleep(0.02)
    await app.usage.sink.drain_once()


async def bucket_tokens(app, tenant) -> float:
    kv = app.services.kv
    return (await kv.token_bucket(f"rl:tok:{tenant['id']}", TPM, TPM / 60.0, 0)).remaining


async def ledger(app, tenant) -> list[UsageRecord]:
    async with app.services.sessions() as s:
        return list((await s.scalars(select(UsageRecord).where(UsageRecord.tenant_id == tenant["id"]))).all())


async def assert_nothing_held(app, tenant) -> None:
    await settled(app)
    services = app.services
    assert services.admission.in_flight == 0, "admission slots leaked"
    assert services.quota.reserved_tokens(tenant["id"]) == 0, "quota reservation leaked"
    assert not services.engine.engine.has_unfinished_requests(), "engine requests left running"
    # nothing used: the bucket is back to (nearly) full; a leaked ~200-token reservation would show
    assert await bucket_tokens(app, tenant) > TPM - 20, "rate-limit tokens not refunded"


async def admitted(app, call: Call) -> asyncio.Task:
    """Start ``call``; returns once it holds an admission slot."""
    before = app.services.admission.in_flight
    task = asyncio.create_task(call.run())
    for _ in range(500):
        if app.services.admission.in_flight > before:
            return task
        assert not task.done(), (call.status, call.body)
        await asyncio.sleep(0.01)
    raise AssertionError("the request was never admitted")


async def normal_request_gets_in(app, tenant) -> None:
    r = await app.client.post("/v1/completions", json=body(max_tokens=2), headers=app.headers(tenant["key"]))
    assert r.status_code == 200, r.text


# ---- the reported leak: echo between prepare() and the engine's start -----------------------------


async def test_cancelled_while_echo_decodes_releases_everything(app, tenant):
    """A token-id prompt with echo is decoded after admission; the request is cancelled right there (a
    server shutting down, a timeout): admission, tokens and quota come back, the engine never ran it."""
    for _ in range(CAP):
        blocked = Blocked(app.services)
        await asyncio.to_thread(blocked.entered.wait, 5)
        call = Call(app.app, tenant["key"], "/v1/completions", body(prompt=[5, 6, 7, 8], echo=True))
        task = await admitted(app, call)
        await blocked.waited_on()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        blocked.release()
        await settled(app)
    await assert_nothing_held(app, tenant)
    assert await ledger(app, tenant) == []  # never reached the engine: not billed
    await normal_request_gets_in(app, tenant)


async def test_stream_whose_response_cannot_start_aborts_and_releases(app, tenant):
    """The engine admitted a stream, then the client is gone before the response headers go out and the
    server's send raises (ASGI 2.4 allows OSError there): the engine request is aborted, the slot and
    the unused tokens come back, and the ledger has one row with no completion tokens."""
    for _ in range(CAP):
        call = Call(app.app, tenant["key"], "/v1/completions", body(stream=True), send_fails_when_gone=True)
        call.leave()
        with pytest.raises(Exception):  # noqa: B017 (the OSError, or Litestar's wrapping of it)
            await call.run()
    await settled(app)
    assert app.services.admission.in_flight == 0, "admission slots leaked"
    assert not app.services.engine.engine.has_unfinished_requests(), "engine requests left running"
    rows = await ledger(app, tenant)
    assert len(rows) == CAP and all(r.completion_tokens == 0 and r.status == "aborted" for r in rows)
    await normal_request_gets_in(app, tenant)


def sse_tokens(call: Call) -> int:
    """Completion tokens in the SSE chunks the client received (each chunk's logprobs list its tokens)."""
    n = 0
    for line in call.body.split(b"\n\n"):
        data = line.removeprefix(b"data: ")
        if data and data != b"[DONE]":
            for choice in json.loads(data).get("choices", []):
                n += len((choice.get("logprobs") or {}).get("tokens") or [])
    return n


@pytest.mark.parametrize("n", [1, 3])
async def test_disconnect_mid_stream_bills_exactly_the_tokens_sent(app, tenant, n):
    call = Call(app.app, tenant["key"], "/v1/completions", body(stream=True, logprobs=0, n=n, ignore_eos=True),
                send_fails_when_gone=True, leave_after_chunks=5)
    with contextlib.suppress(Exception):  # the send's OSError (Litestar may wrap it), unless the listener won
        await call.run()
    await settled(app)
    sent = sse_tokens(call)
    assert 0 < sent < 180 * n
    (row,) = await ledger(app, tenant)
    assert row.status == "aborted" and row.completion_tokens == sent
    assert app.services.admission.in_flight == 0
    assert not app.services.engine.engine.has_unfinished_requests()
    # the bucket was charged for what was used, the rest refunded
    assert await bucket_tokens(app, tenant) > TPM - row.prompt_tokens - sent - 20


async def test_disconnect_before_the_engine_answers_is_a_released_idempotency_key(app, tenant):
    """Non-streaming: the client has left when the request arrives; the request is aborted long before its 180
    tokens, billed only for what the engine made before the abort reached it (the engine thread may make a token
    or two while the disconnect watcher starts: on a loaded 2-core machine the full suite saw one), and its
    Idempotency-Key is free again (a retry runs)."""
    key = {"Idempotency-Key": f"k-{uuid.uuid4().hex}"}
    call = Call(app.app, tenant["key"], "/v1/completions", body(), headers=key)
    call.leave()
    await call.run()
    assert call.status == 499
    await settled(app)
    (row,) = await ledger(app, tenant)
    assert row.status == "aborted" and row.completion_tokens < body()["max_tokens"] // 4
    assert app.services.admission.in_flight == 0
    r = await app.client.post("/v1/completions", json=body(max_tokens=2), headers={**app.headers(tenant["key"]), **key})
    assert r.status_code == 200 and "idempotent-replayed" not in r.headers, r.text


@pytest.mark.parametrize("stream", [False, True])
async def test_engine_refusal_after_admission_is_not_billed_and_releases(app, tenant, stream):
    """The engine refuses what validation let through (more samples than it runs at once): a 400, nothing
    billed, slot and tokens back; with an Idempotency-Key the 400 is replayed."""
    key = {"Idempotency-Key": f"k-{uuid.uuid4().hex}"}
    refused = body(stream=stream, n=MAX_NUM_SEQS + 1, max_tokens=100)  # fits TPM: the engine is the one to refuse
    for _ in range(CAP + 1):
        call = Call(app.app, tenant["key"], "/v1/completions", refused, headers=key)
        await call.run()
        assert call.status == 400, call.body
    await assert_nothing_held(app, tenant)
    assert await ledger(app, tenant) == []
    await normal_request_gets_in(app, tenant)


async def test_quota_refusal_refunds_rate_limit_tokens(app, tenant):
    r = await app.client.put(f"/admin/tenant-plans/{tenant['name']}", json={"monthly_token_quota": 50},
                             headers=app.headers())
    assert r.status_code == 200
    for _ in range(CAP + 1):
        call = Call(app.app, tenant["key"], "/v1/completions", body())
        await call.run()
        assert call.status == 429 and b"insufficient_quota" in call.body
    await assert_nothing_held(app, tenant)
    assert await ledger(app, tenant) == []


async def test_a_failure_while_finishing_still_gives_back_the_slot(app, tenant, monkeypatch):
    """Finishing a request runs metrics, the limiter's settlement and the usage record; an exception in one of
    them must not keep the admission slot or the quota reservation, nor cost the usage record."""
    metrics = app.services.metrics

    class Broken:
        def labels(self, *a):
            raise RuntimeError("metrics backend broke")

    monkeypatch.setattr(metrics, "e2e", Broken())
    before = len(await ledger(app, tenant))
    for _ in range(CAP + 1):
        r = await app.client.post("/v1/completions", json=body(max_tokens=2), headers=app.headers(tenant["key"]))
        assert r.status_code == 200, r.text
        await settled(app)
    monkeypatch.undo()
    rows = (await ledger(app, tenant))[before:]
    assert len(rows) == CAP + 1 and all(row.completion_tokens == 2 for row in rows)
    assert app.services.admission.in_flight == 0, "admission slots leaked"
    assert app.services.quota.reserved_tokens(tenant["id"]) == 0
    await normal_request_gets_in(app, tenant)


# ---- what a cancelled request is billed for its prompt: what the engine ran ----------------------


class SteppedLoop:
    """Runs the engine loop one step at a time (each step waits for ``advance`` before it returns), so a test
    knows exactly what the engine has computed when the client leaves."""

    def __init__(self, app):
        self.engine = app.services.engine
        self.core = self.engine.engine
        self._step = self.core.step
        self._permits = threading.Semaphore(0)
        self.steps = 0
        self.core.step = self._held_step

    def _held_step(self):
        out = self._step()
        self.steps += 1
        self._permits.acquire(timeout=30)
        return out

    async def after_step(self, n: int) -> None:
        for _ in range(1000):
            if self.steps >= n:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"the engine never finished step {n}")

    async def command_queued(self) -> None:
        """Returns once a request or an abort waits for the held loop."""
        for _ in range(1000):
            if not self.engine._commands.empty():
                return
            await asyncio.sleep(0.01)
        raise AssertionError("nothing reached the engine")

    def advance(self) -> None:
        self._permits.release()

    def release(self) -> None:
        self.core.step = self._step
        self._permits.release(1000)


async def test_a_request_cancelled_while_waiting_for_the_engine_is_not_billed_its_prompt(app, tenant):
    """Every sequence of the engine is busy, so the next request waits in its queue; its client leaves there:
    the ledger row bills no prompt tokens (nothing ran). The busy request, cancelled after it ran, is billed
    its whole prompt."""
    stepped = SteppedLoop(app)
    try:
        busy = Call(app.app, tenant["key"], "/v1/completions", body(n=MAX_NUM_SEQS, max_tokens=100, ignore_eos=True))
        busy_task = asyncio.create_task(busy.run())
        await stepped.after_step(1)  # admitted: its prompt ran, its samples hold every sequence
        queued = Call(app.app, tenant["key"], "/v1/completions", body(prompt=list(range(5, 45)), max_tokens=20))
        queued_task = asyncio.create_task(queued.run())
        await stepped.command_queued()
        stepped.advance()  # the loop takes the new request, which cannot run yet, and steps the busy one
        await stepped.after_step(2)
        assert [r.num_prompt_tokens for r in stepped.core.scheduler.waiting] == [40]
        queued.leave()
        await stepped.command_queued()  # its abort
        stepped.release()
        await queued_task
        busy.leave()
        await busy_task
    finally:
        stepped.release()
    await settled(app)
    rows = {r.prompt_tokens: r for r in await ledger(app, tenant)}
    assert queued.status == 499 and busy.status == 499
    busy_prompt = len(app.services.engine.encode(body()["prompt"]))
    assert sorted(rows) == [0, busy_prompt], rows
    assert rows[0].status == "aborted" and rows[0].completion_tokens == 0 and rows[0].cached_prompt_tokens == 0
    assert rows[busy_prompt].status == "aborted"
    await assert_nothing_held(app, tenant)


async def test_a_request_cancelled_mid_prefill_is_billed_the_prompt_chunks_that_ran(app, tenant, monkeypatch):
    """A 40-token prompt runs in chunks of 16; the client leaves after the first chunk: 16 prompt tokens are
    billed, not 40."""
    stepped = SteppedLoop(app)
    monkeypatch.setattr(stepped.core.scheduler.config, "max_num_batched_tokens", 16)
    try:
        call = Call(app.app, tenant["key"], "/v1/completions", body(prompt=list(range(5, 45))))
        task = asyncio.create_task(call.run())
        await stepped.after_step(1)
        call.leave()
        await stepped.command_queued()
        stepped.release()
        await task
    finally:
        stepped.release()
    monkeypatch.undo()
    await settled(app)
    (row,) = await ledger(app, tenant)
    assert call.status == 499 and row.status == "aborted"
    assert (row.prompt_tokens, row.completion_tokens) == (16, 0)
    await assert_nothing_held(app, tenant)
