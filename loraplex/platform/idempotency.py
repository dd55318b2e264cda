"""``Idempotency-Key`` for the routes where a retry could double-charge or double-create.

A record per (tenant, route, key) lives in the platform kv for :data:`RECORD_TTL_S`:

- ``pending``: one request holds the key. The claim is an atomic set-if-absent in the kv (SET NX in Redis),
  so two replicas racing for a key see one winner; the loser gets 409 ``idempotency_key_in_use``. The claim
  expires after :data:`LEASE_S`, so a replica that dies mid-request frees the key.
- ``done``: status, content type and body of the first answer. The same request again gets that answer with
  ``idempotent-replayed: true`` (the engine does not run, nothing is billed); a different body with the same
  key is 422 ``idempotency_key_reused``.

5xx, 408, 409, 429 and a client that went away release the key (the client may retry); other 4xx are stored and
replayed, like Stripe. A stream cannot be replayed: once started, its key answers 409
``idempotent_replay_unavailable``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import msgspec
from litestar import MediaType, Request, Response
from litestar.params import Parameter

from loraplex.platform.auth import principal_of
from loraplex.platform.errors import ApiError, ErrorBody, ErrorResponse, bad_request

HEADER = "Idempotency-Key"
REPLAYED_HEADER = "idempotent-replayed"
RECORD_TTL_S = 24 * 3600.0
LEASE_S = 20 * 60.0  # longer than any request (uploads have a 900 s deadline)
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
    except ValueError:
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
        if not await self.kv.set_if_absent("claim:" + scope, "1", self.lease_s):
            rec = await self._record(scope)  # the holder may have finished meanwhile
            if rec is not None and rec["state"] == "done":
                return self._answer(rec, fp)
            if rec is not None and fp is not None and rec.get("fp") not in (None, fp):
                raise reused()
            raise in_use()
        await self.kv.set(scope, json.dumps({"state": "pending", "fp": fp}), self.ttl_s)
        return None

    async def complete(self, scope: str, fp: str, stored: Stored) -> None:
        rec = {"state": "done", "fp": fp, "status": stored.status, "media_type": stored.media_type,
               "body": stored.body.decode("latin-1"), "streamed": stored.streamed}
        await self.kv.set(scope, json.dumps(rec), self.ttl_s)

    async def release(self, scope: str) -> None:
        await self.kv.delete(scope)
        await self.kv.delete("claim:" + scope)


def store_of(request: Request) -> IdempotencyStore:
    return IdempotencyStore(request.app.state.services.kv)


def _releases(status: int) -> bool:
    # worth retrying: server faults, limits, timeouts, a lost race (409) and a client that went away
    return status >= 500 or status in (408, 409, 429, 499)


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
        response = await run()
    except ApiError as exc:
        if _releases(exc.status_code):
            await store.release(scope)
        else:
            await store.complete(scope, fp, Stored(exc.status_code, MediaType.JSON, error_body(exc)))
        raise
    except BaseException:
        await store.release(scope)
        raise
    if streamed:
        body = b""
    else:
        body = response.content if isinstance(response.content, bytes) else msgspec.json.encode(response.content)
    await store.complete(scope, fp, Stored(response.status_code or 200, MediaType.JSON, body, streamed))
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
    try:
        response = await run()
    except ApiError as exc:
        if _releases(exc.status_code) or not hashing.complete:  # a partly read body has no fingerprint
            await store.release(scope)
        else:
            fp = fingerprint(request.method, request.url.path, hashing.digest.hexdigest())
            await store.complete(scope, fp, Stored(exc.status_code, MediaType.JSON, error_body(exc)))
        raise
    except BaseException:
        await store.release(scope)
        raise
    if not hashing.complete:  # the handler answered without reading the whole body: nothing to compare later
        await store.release(scope)
        return response
    fp = fingerprint(request.method, request.url.path, hashing.digest.hexdigest())
    body = response.content if isinstance(response.content, bytes) else msgspec.json.encode(response.content)
    await store.complete(scope, fp, Stored(response.status_code or 200, MediaType.JSON, body))
    return response
