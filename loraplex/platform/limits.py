"""Per-tenant rate limits (requests/min and tokens/min token buckets) and the global admission cap.

Buckets live in the KV store, so with Redis every replica shares one bucket per tenant. A request
is charged ``prompt + max_tokens`` tokens up front (the most it can use) and refunded the unused part
when it ends, like OpenAI's estimate-then-settle accounting.
"""

from __future__ import annotations

from dataclasses import dataclass

from loraplex.platform.auth import Principal
from loraplex.platform.errors import overloaded, rate_limited
from loraplex.platform.kv import KV, BucketResult, ceil_s
from loraplex.settings import Settings


def _fmt_duration(seconds: float) -> str:
    return f"{max(0.0, seconds):.3f}s"


@dataclass
class RateGrant:
    """Admission granted; ``charged_tokens`` is settled by :meth:`RateLimiter.settle`."""

    tenant_id: str
    charged_tokens: int
    headers: dict[str, str]


def _headers(req: BucketResult | None, tok: BucketResult | None) -> dict[str, str]:
    h: dict[str, str] = {}
    if req is not None:
        h["x-ratelimit-limit-requests"] = str(int(req.capacity))
        h["x-ratelimit-remaining-requests"] = str(max(0, int(req.remaining)))
        h["x-ratelimit-reset-requests"] = _fmt_duration(req.reset_s)
    if tok is not None:
        h["x-ratelimit-limit-tokens"] = str(int(tok.capacity))
        h["x-ratelimit-remaining-tokens"] = str(max(0, int(tok.remaining)))
        h["x-ratelimit-reset-tokens"] = _fmt_duration(tok.reset_s)
    return h


class RateLimiter:
    def __init__(self, kv: KV, settings: Settings):
        self._kv = kv
        self._settings = settings

    def limits(self, principal: Principal) -> tuple[int, int]:
        rpm = principal.requests_per_minute or self._settings.default_requests_per_minute
        tpm = principal.tokens_per_minute or self._settings.default_tokens_per_minute
        return rpm, tpm

    async def admit(self, principal: Principal, estimated_tokens: int) -> RateGrant:
        """Take one request and ``estimated_tokens`` from the tenant's buckets, or raise a 429."""
        rpm, tpm = self.limits(principal)
        req_key, tok_key = f"rl:req:{principal.tenant_id}", f"rl:tok:{principal.tenant_id}"
        req = await self._kv.token_bucket(req_key, rpm, rpm / 60.0, 1)
        if not req.allowed:
            raise rate_limited(
                f"Rate limit reached: {rpm} requests per minute for this tenant. Retry after "
                f"{ceil_s(req.retry_after_s)}s.", ceil_s(req.retry_after_s), _headers(req, None),
                code="rate_limit_exceeded",
            )
        # a request bigger than the whole bucket waits for a full bucket rather than never running
        cost = min(estimated_tokens, tpm)
        tok = await self._kv.token_bucket(tok_key, tpm, tpm / 60.0, cost)
        if not tok.allowed:
            await self._kv.token_bucket(req_key, rpm, rpm / 60.0, -1, force=True)
            raise rate_limited(
                f"Rate limit reached: {tpm} tokens per minute for this tenant (this request needs up to "
                f"{estimated_tokens}). Retry after {ceil_s(tok.retry_after_s)}s.",
                ceil_s(tok.retry_after_s), _headers(req, tok), code="rate_limit_exceeded",
            )
        return RateGrant(principal.tenant_id, cost, _headers(req, tok))

    async def settle(self, principal: Principal, grant: RateGrant, used_tokens: int) -> None:
        """Refund (or charge) the difference between the estimate and what the request used."""
        delta = used_tokens - grant.charged_tokens
        if delta:
            _, tpm = self.limits(principal)
            await self._kv.token_bucket(f"rl:tok:{principal.tenant_id}", tpm, tpm / 60.0, delta, force=True)


class Admission:
    """Global cap on requests in the engine (per process): beyond it, a fast 503."""

    def __init__(self, limit: int):
        self.limit = limit
        self.in_flight = 0

    def acquire(self) -> None:
        if self.in_flight >= self.limit:
            raise overloaded(f"Server is at capacity ({self.limit} concurrent requests); retry shortly.", 1)
        self.in_flight += 1

    def release(self) -> None:
        assert self.in_flight > 0, "admission released more often than acquired"
        self.in_flight -= 1
