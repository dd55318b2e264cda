"""``Idempotency-Key`` for the routes where a retry could double-charge or double-create.

A record per (tenant, route, key) lives in the platform kv for :data:`RECORD_TTL_S`:

- a claim: one request holds the key. It is one atomic set-if-absent in the kv (SET NX in Redis) holding the
  body's fingerprint, so two replicas racing for a key see one winner; the loser gets 409
  ``idempotency_key_in_use`` (422 for another body). The claim is a lease of :data:`LEASE_S`, renewed while
  the request runs, so a replica that dies (or loses Redis) mid-request frees the key within the lease.
- ``done``: status, content type and body of the first answer. The same request again gets that answer with
  ``idempotent-replayed: true`` (the engine does not run, nothing is billed); a different body with the same
  key is 422 ``idempotency_key_reused``.

5xx, 408, 409, 429 and a client that went away release the key (the client may retry); other 4xx are stored and
replayed, like Stripe. A stream cannot be replayed: once started, its key answers 409
``idempotent_replay_unavailable``.

Redis unreachable before the request runs: the kv error is a 503 ``service_unavailable`` (errors.py). Once the
request ran, its answer is returned even when it cannot be recorded: the key is then released if Redis lets us,
else its lease lapses, and a retry runs again.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import msgspec
from litestar import MediaType, Request, Response
from litestar.params import Parameter

from loraplex.platform.auth import principal_of
from loraplex.platform.errors import ApiError, ErrorBody, ErrorResponse, bad_request

log = logging.getLogger(__name__)

HEADER = "Idempotency-Key"
REPLAYED_HEADER = "idempotent-replayed"
RECORD_TTL_S = 24 * 3600.0
LEASE_S = 30.0  # renewed every third of it while the request runs
MAX_KEY_LEN = 255

# declare the header in OpenAPI; the handler validates it (a framework pattern check would not name the header)
KEY_PARAMETER = Parameter(header=HEADER, required=False, description=(
    "Makes a retry safe: the same key with the same body within 24 h returns the first response instead of "
    "running again (1-255 printable ASCII characters)."))


def check_key(value: str | None) -> str | None:
    if value is None:
        return None
    if not 1 <= len(value) <= MAX_KEY_LEN or not all(" " <= c <= "~" for c in value):
        raise bad_request(f"{HEADER} must be 1-{MAX_KEY_LEN} printable ASCII characters.", param=HEADER)
    return value


def fingerprint(method: str, path: str, body_sha256: str) -> str:
    return hashlib.sha256(f"{method}\n{path}\n{body_sha256}".encode()).hexdigest()


def json_body_sha256(raw: bytes) -> str:
    """The hash of the canonical JSON body: key order and whitespace do not make a request different."""
    try:
        canonical = json.dumps(json.loads(raw), sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    except (ValueError, RecursionError):  # not JSON, or nested deeper than json can recurse: the bytes as sent
        canonical = raw
    return hashlib.sha256(canonical).hexdigest()


def in_use() -> ApiError:
    return ApiError(409, f"A request with this {HEADER} is still in progress; retry after it finishes.",
                    param=HEADER, code="idempotency_key_in_use", headers={"Retry-After": "1"})


def reused() -> ApiError:
    return ApiError(422, f"This {HEADER} was already used with a different request body (or route); use a new key.",
                    param=HEADER, code="idempotency_key_reused")


def replay_unavailable() -> ApiError:
    return ApiError(409, f"This {HEADER} was used for a streamed response, which cannot be replayed; use a new "
                    "key to run the request again.", param=HEADER, code="idempotent_replay_unavailable")


@dataclass(frozen=True)
class Stored:
    status: int
    media_type: str
    body: bytes
    streamed: bool = False


class IdempotencyStore:
    """Records in the platform kv, scoped per tenant and route (the key itself is hashed, never stored)."""

    def __init__(self, kv, ttl_s: float = RECORD_TTL_S, lease_s: float = LEASE_S):
        self.kv, self.ttl_s, self.lease_s = kv, ttl_s, lease_s

    @staticmethod
    def scope(tenant_id: str, route: str, key: str) -> str:
        return f"idem:{tenant_id}:{route}:{hashlib.sha256(key.encode()).hexdigest()}"

    async def _record(self, scope: str) -> dict | None:
        raw = await self.kv.get(scope)
        return None if raw is None else json.loads(raw)

    @staticmethod
    def _answer(rec: dict, fp: str | None) -> Stored:
        if fp is not None and rec["fp"] != fp:
            raise reused()
        if rec.get("streamed"):
            raise replay_unavailable()
        return Stored(rec["status"], rec["media_type"], rec["body"].encode("latin-1"))

    async def lookup(self, scope: str, fp: str | None) -> Stored | None:
        """The stored answer for a finished request (422 if ``fp`` differs); None if there is none yet."""
        rec = await self._record(scope)
        if rec is None or rec["state"] != "done":
            return None
        return self._answer(rec, fp)

    async def claim(self, scope: str, fp: str | None) -> Stored | None:
        """Hold the key for this request (None), or the earlier answer; 409/422 when it is not ours to run."""
        stored = await self.lookup(scope, fp)
        if stored is not None:
            return stored
        if not await self.kv.set_if_absent("claim:" + scope, json.dumps({"fp": fp}), self.lease_s):
            rec = await self._record(scope)  # the holder may have finished meanwhile
            if rec is not None and rec["state"] == "done":
                return self._answer(rec, fp)
            held = json.loads(await self.kv.get("claim:" + scope) or "{}")
            held_fp = held.get("fp") if isinstance(held, dict) else None  # "1": a claim of an older release
            if fp is not None and held_fp not in (None, fp):
                raise reused()
            raise in_use()
        return None

    @contextlib.asynccontextmanager
    async def holding(self, scope: str, fp: str | None):
        """Renew the claim while the body runs: the lease only has to outlast one missed renewal, so a key
        whose holder died or lost Redis is free again soon, while a slow request keeps it."""

        async def renew() -> None:
            while True:
                await asyncio.sleep(self.lease_s / 3)
                try:
                    await self.kv.set("claim:" + scope, json.dumps({"fp": fp}), self.lease_s)
                except Exception:  # Redis away: try again next time; if it stays away the claim lapses
                    log.warning("idempotency claim not renewed", exc_info=True)

        task = asyncio.create_task(renew(), name="idempotency-lease")
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def complete(self, scope: str, fp: str, stored: Stored) -> None:
        rec = {"state": "done", "fp": fp, "status": stored.status, "media_type": stored.media_type,
               "body": stored.body.decode("latin-1"), "streamed": stored.streamed}
        await self.kv.set(scope, json.dumps(rec), self.ttl_s)

    async def release(self, scope: str) -> None:
        await self.kv.delete(scope)
        await self.kv.delete("claim:" + scope)

    async def finish(self, scope: str, fp: str | None, stored: Stored | None) -> None:
        """Record the answer (``stored``), or free the key for a retry (None). The request has run, so a kv
        failure here is logged, never raised: the answer still goes out, and the key is released if the kv
        lets us, else its lease lapses (a retry runs again instead of being refused)."""
        try:
            if stored is None:
                await self.release(scope)
            else:
                await self.complete(scope, fp, stored)
            return
        except Exception:
            log.warning("idempotency record not %s", "released" if stored is None else "stored", exc_info=True)
        if stored is not None:
            with contextlib.suppress(Exception):
                await self.release(scope)


def store_of(request: Request) -> IdempotencyStore:
    return IdempotencyStore(request.app.state.services.kv)


def _failure(exc: ApiError) -> Stored | None:
    """What a failed request leaves under its key: None frees it (worth retrying: server faults, limits,
    timeouts, a lost race (409) and a client that went away); other errors are replayed."""
    if exc.status_code >= 500 or exc.status_code in (408, 409, 429, 499):
        return None
    return Stored(exc.status_code, MediaType.JSON, error_body(exc))


def replay(stored: Stored) -> Response:
    return Response(stored.body, status_code=stored.status, media_type=stored.media_type,
                    headers={REPLAYED_HEADER: "true"})


def error_body(exc: ApiError) -> bytes:
    return msgspec.json.encode(ErrorResponse(ErrorBody(message=exc.message, type=exc.type, param=exc.param,
                                                       code=exc.code)))


async def run_once(store: IdempotencyStore, scope: str, fp: str, run: Callable[[], Awaitable[Response]],
                   streamed: bool = False) -> Response:
    """Run ``run`` unless this key already has an answer; store what it answers (JSON bodies only)."""
    stored = await store.claim(scope, fp)
    if stored is not None:
        return replay(stored)
    try:
        async with store.holding(scope, fp):
            response = await run()
    except ApiError as exc:
        await store.finish(scope, fp, _failure(exc))
        raise
    except BaseException:
        await store.finish(scope, fp, None)
        raise
    if streamed:
        body = b""
    else:
        body = response.content if isinstance(response.content, bytes) else msgspec.json.encode(response.content)
    await store.finish(scope, fp, Stored(response.status_code or 200, MediaType.JSON, body, streamed))
    return response


async def json_route(request: Request, key: str | None, route: str, streamed: bool,
                     run: Callable[[], Awaitable[Response]]) -> Response:
    """``run`` under ``Idempotency-Key`` for a JSON-body route (a no-op without the header)."""
    key = check_key(key)
    if key is None:
        return await run()
    principal = await principal_of(request)
    fp = fingerprint(request.method, request.url.path, json_body_sha256(await request.body()))
    store = store_of(request)
    return await run_once(store, store.scope(principal.tenant_id, route, key), fp, run, streamed)


class _HashingReceive:
    """Hashes the body as the handler streams it (nothing is kept); ``complete`` once the last part arrived."""

    def __init__(self, receive):
        self._receive = receive
        self.digest = hashlib.sha256()
        self.complete = False

    async def __call__(self):
        message = await self._receive()
        if message["type"] == "http.request":
            self.digest.update(message.get("body", b""))
            if not message.get("more_body", False):
                self.complete = True
        return message


async def _drain_sha256(request: Request, max_bytes: int) -> str:
    from loraplex.platform.registry.upload import too_large

    digest, total = hashlib.sha256(), 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > max_bytes:
            raise too_large(max_bytes)
        digest.update(chunk)
    return digest.hexdigest()


async def upload_route(request: Request, key: str | None, route: str, max_bytes: int,
                       run: Callable[[], Awaitable[Response]]) -> Response:
    """``run`` under ``Idempotency-Key`` for a streamed upload: the fingerprint is the sha256 of the raw body,
    known only once the handler has read it, so a stored answer is compared after draining the body."""
    key = check_key(key)
    if key is None:
        return await run()
    principal = await principal_of(request)
    store = store_of(request)
    scope = store.scope(principal.tenant_id, route, key)

    async def stored_answer() -> Response:
        fp = fingerprint(request.method, request.url.path, await _drain_sha256(request, max_bytes))
        stored = await store.lookup(scope, fp)
        assert stored is not None  # done records are never changed back
        return replay(stored)

    if await store.lookup(scope, None) is not None or await store.claim(scope, None) is not None:
        return await stored_answer()
    hashing = _HashingReceive(request.receive)
    request.receive = hashing

    def body_fp() -> str:
        return fingerprint(request.method, request.url.path, hashing.digest.hexdigest())

    try:
        async with store.holding(scope, None):
            response = await run()
    except ApiError as exc:
        # a partly read body has no fingerprint to compare a retry with
        await store.finish(scope, body_fp(), _failure(exc) if hashing.complete else None)
        raise
    except BaseException:
        await store.finish(scope, None, None)
        raise
    if not hashing.complete:  # the handler answered without reading the whole body: nothing to compare later
        await store.finish(scope, None, None)
        return response
    body = response.content if isinstance(response.content, bytes) else msgspec.json.encode(response.content)
    await store.finish(scope, body_fp(), Stored(response.status_code or 200, MediaType.JSON, body))
    return response
