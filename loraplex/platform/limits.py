"""Per-tenant rate limits (requests/min and tokens/min token buckets) and the global admission cap.

Buckets live in the KV store, so with Redis every replica shares one bucket per tenant. A request
is charged ``prompt + max_tokens × n`` tokens up front (the most it can use) and refunded the unused part
when it ends, like OpenAI's estimate-then-settle accounting. A request whose charge is more than the whole
bucket could never be admitted: :meth:`RateLimiter.fit` refuses it before anything is taken or reserved.
"""

from __future__ import annotations

from dataclasses import dataclass

from loraplex.platform.auth import Principal
from loraplex.platform.errors import ApiError, overloaded, rate_limited
from loraplex.platform.kv import KV, BucketResult, ceil_s
from loraplex.settings import Settings


def _fmt_duration(seconds: float) -> str:
    return f"{max(0.0, seconds):.3f}s"


@dataclass(frozen=True)
class RequestSize:
    """What a request would charge the tokens-per-minute bucket: ``prompt_tokens + max_tokens × sequences``."""

    model: str  # as the client named it (the error names it, as OpenAI's does)
    prompt_tokens: int  # all prompts together
    max_tokens: int
    sequences: int  # n × number of prompts
    # the server's default budget (a chat request without max_tokens): no promise, so it may be cut to fit,
    # down to ``min_budget`` (1, or min_tokens)
    default_budget: bool
    min_budget: int
    max_tokens_param: str  # the request's own names, for the error
    prompt_param: str


def request_too_large(size: RequestSize, tpm: int) -> ApiError:
    """429 as OpenAI's "Request too large" (code ``rate_limit_exceeded``), but with ``x-should-retry: false`` and
    no ``Retry-After``: the request can never fit the bucket, so an OpenAI client must not retry it."""
    fits = (tpm - size.prompt_tokens) // size.sequences  # the largest max_tokens that fits
    choices = f" × {size.sequences} choices" if size.sequences > 1 else ""
    fewer = " or lower n" if size.sequences > 1 else ""
    if size.default_budget:
        asked = (f"{size.prompt_tokens} prompt + at least {size.min_budget} completion token"
                 f"{'s' if size.min_budget > 1 else ''}{choices}")
    else:
        asked = f"{size.prompt_tokens} prompt + {size.max_tokens_param} {size.max_tokens}{choices}"
    if not size.default_budget and fits >= 1:
        param, fix = size.max_tokens_param, f"Lower {size.max_tokens_param} to at most {fits}{fewer}."
    else:
        fewer += " or lower min_tokens" if size.min_budget > 1 else ""
        per_choice = " per choice" if size.sequences > 1 else ""
        param, fix = size.prompt_param, (f"Shorten {size.prompt_param}{fewer}: this prompt leaves room for "
                                         f"{max(0, fits)} completion tokens{per_choice}.")
    requested = size.prompt_tokens + (size.min_budget if size.default_budget else size.max_tokens) * size.sequences
    return ApiError(
        429, f"Request too large for {size.model}: Limit {tpm} tokens per minute, Requested {requested} ({asked}). "
             f"{fix} A request larger than the per-minute limit can never run, so retrying will not help.",
        type="rate_limit_error", param=param, code="rate_limit_exceeded", headers={"x-should-retry": "false"},
    )


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

    def fit(self, principal: Principal, size: RequestSize) -> int:
        """The ``max_tokens`` the request runs with: its own, or a default budget cut to what the tenant's whole
        tokens-per-minute bucket holds; a request that cannot fit even so is refused (nothing is taken)."""
        _, tpm = self.limits(principal)
        max_tokens = size.max_tokens
        if size.default_budget:
            max_tokens = max(size.min_budget, min(max_tokens, (tpm - size.prompt_tokens) // size.sequences))
        if size.prompt_tokens + max_tokens * size.sequences > tpm:
            raise request_too_large(size, tpm)
        return max_tokens

    async def admit(self, principal: Principal, estimated_tokens: int) -> RateGrant:
        """Take one request and ``estimated_tokens`` (at most the tokens-per-minute limit: :meth:`fit` saw to it)
        from the tenant's buckets, or raise a 429."""
        rpm, tpm = self.limits(principal)
        assert estimated_tokens <= tpm, "a request larger than the bucket reached admit(): fit() refuses those"
        req_key, tok_key = f"rl:req:{principal.tenant_id}", f"rl:tok:{principal.tenant_id}"
        req = await self._kv.token_bucket(req_key, rpm, rpm / 60.0, 1)
        if not req.allowed:
            raise rate_limited(
                f"Rate limit reached: {rpm} requests per minute for this tenant. Retry after "
                f"{ceil_s(req.retry_after_s)}s.", ceil_s(req.retry_after_s), _headers(req, None),
                code="rate_limit_exceeded",
            )
        tok = await self._kv.token_bucket(tok_key, tpm, tpm / 60.0, estimated_tokens)
        if not tok.allowed:
            await self._kv.token_bucket(req_key, rpm, rpm / 60.0, -1, force=True)
            raise rate_limited(
                f"Rate limit reached: {tpm} tokens per minute for this tenant (this request needs up to "
                f"{estimated_tokens}). Retry after {ceil_s(tok.retry_after_s)}s.",
                ceil_s(tok.retry_after_s), _headers(req, tok), code="rate_limit_exceeded",
            )
        return RateGrant(principal.tenant_id, estimated_tokens, _headers(req, tok))

    async def settle(self, principal: Principal, grant: RateGrant, used_tokens: int) -> None:
        """Refund what the request did not use of its charge. It never takes more afterwards: the charge was the
        most the request could use, and a forced take after the fact is what drove buckets below zero."""
        refund = grant.charged_tokens - used_tokens
        if refund > 0:
            _, tpm = self.limits(principal)
            await self._kv.token_bucket(f"rl:tok:{principal.tenant_id}", tpm, tpm / 60.0, -refund, force=True)


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
