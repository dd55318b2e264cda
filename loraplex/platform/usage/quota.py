"""Monthly token quotas, checked at admission (before the engine sees the request).

A request may start only if ``used + reserved + its own estimate <= quota`` for the tenant's current UTC
month, where ``used`` = the ledger's total (cached for a few seconds) + what this process has written to
the ledger since + events still in this process's spool, and ``reserved`` = the estimates
(``prompt + max_tokens * n``) of this process's requests still running. A reservation is released when
the request's usage event is in the sink, so no token is ever invisible to the check.

A request that did not set ``max_tokens`` runs on the server's default budget (the rest of the context, up to
``max_tokens_limit``), which is no promise to the client: it is cut to what is left of the quota (down to
``at_least``: the prompt and one completion token per choice), so a tenant near its quota is not refused a
small request for a worst case it never asked for, and the quota still holds exactly.

With several replicas, each sees the others' usage once it reaches the ledger and the cache expires
(:data:`LEDGER_CACHE_TTL_S`): a burst spread over replicas can overshoot by what they admit in that time.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime

from loraplex.platform.auth import Principal
from loraplex.platform.db import SessionFactory, utcnow
from loraplex.platform.errors import ApiError
from loraplex.platform.single_flight import SingleFlight
from loraplex.platform.usage.ledger import as_utc, billable_tokens, tokens_used
from loraplex.platform.usage.plans import tenant_billing
from loraplex.platform.usage.pricing import month_bounds

log = logging.getLogger(__name__)

LEDGER_CACHE_TTL_S = 5.0
PLAN_CACHE_TTL_S = 5.0


def insufficient_quota(quota: int, used: int, needed: int, *, default_budget: bool = False) -> ApiError:
    """``default_budget``: the request set no ``max_tokens`` and ``needed`` is the least it could run on."""
    left = max(0, quota - used)
    if left == 0:
        message = f"You exceeded your monthly token quota ({quota} tokens); it resets at the start of next month (UTC)."
    elif default_budget:
        message = (f"This request needs at least {needed} tokens (its prompt and its first completion tokens; "
                   f"without max_tokens the completion is cut to what the quota has left) but only {left} of the "
                   f"monthly quota of {quota} tokens are left; shorten the prompt or wait for next month.")
    else:
        message = (f"This request may use up to {needed} tokens (prompt + max_tokens x n) but only {left} of the "
                   f"monthly quota of {quota} tokens are left; lower max_tokens or wait for next month.")
    # x-should-retry: false tells OpenAI clients not to retry a 429 that waiting will not fix
    return ApiError(429, message, type="insufficient_quota", code="insufficient_quota",
                    headers={"x-should-retry": "false"})


def _stale(hit: tuple | None, exc: Exception) -> tuple:
    """The database is unreachable: an expired cache entry beats refusing everyone; without one, 503."""
    if hit is None:
        log.warning("quota lookup failed and nothing is cached: %s", exc)
        raise ApiError(503, "Quota information is unavailable; retry shortly.", type="server_error",
                       code="quota_unavailable", headers={"Retry-After": "5"}) from exc
    log.warning("quota lookup failed (%s); using the last known value", exc)
    return hit


@dataclass
class Reservation:
    tenant_id: str
    month: datetime
    tokens: int


class QuotaTracker:
    def __init__(self, sessions: SessionFactory, sink, *, clock=utcnow,
                 ledger_ttl_s: float = LEDGER_CACHE_TTL_S, plan_ttl_s: float = PLAN_CACHE_TTL_S):
        self.sessions = sessions
        self.sink = sink  # LedgerSink: events not yet in the ledger
        self.clock = clock
        self.ledger_ttl_s = ledger_ttl_s
        self.plan_ttl_s = plan_ttl_s
        self._quotas: dict[str, tuple[float, int | None]] = {}
        # (tenant, month) -> (expires, ledger total, self._ingested at load)
        self._ledger: dict[tuple[str, datetime], tuple[float, int, int]] = {}
        self._ingested: dict[tuple[str, datetime], int] = defaultdict(int)
        # tenant -> month a running request was admitted in -> the tokens those requests reserved (per tenant: an
        # admission sums its own tenant's months, not every tenant's)
        self._reserved: dict[str, dict[datetime, int]] = {}
        # a burst of requests after an entry expires makes one query per key, not one each
        self._quota_reads: SingleFlight[int | None] = SingleFlight()
        self._ledger_reads: SingleFlight[tuple[int, int]] = SingleFlight()

    # ---- hooks ------------------------------------------------------------------------------------

    def on_ingested(self, records: list[dict]) -> None:
        """Records newly written to the ledger by this process."""
        for r in records:
            month, _ = month_bounds(as_utc(datetime.fromisoformat(r["created_at"])))
            self._ingested[(r["tenant_id"], month)] += billable_tokens(r)

    def invalidate(self, tenant_id: str | None = None) -> None:
        """Forget cached plans/quotas (after an admin change)."""
        if tenant_id is None:
            self._quotas.clear()
        else:
            self._quotas.pop(tenant_id, None)

    # ---- queries ----------------------------------------------------------------------------------

    def _now_s(self) -> float:
        return self.clock().timestamp()

    async def quota_of(self, tenant_id: str) -> int | None:
        hit = self._quotas.get(tenant_id)
        if hit is not None and hit[0] > self._now_s():
            return hit[1]
        try:
            return await self._quota_reads.run(tenant_id, lambda: self._read_quota(tenant_id))
        except Exception as exc:
            return _stale(hit, exc)[1]

    async def _read_quota(self, tenant_id: str) -> int | None:
        async with self.sessions() as session:
            _, quota = await tenant_billing(session, tenant_id)
        self._quotas[tenant_id] = (self._now_s() + self.plan_ttl_s, quota)
        return quota

    async def used(self, tenant_id: str, when: datetime | None = None) -> int:
        """Tokens of the month of ``when`` (default now): ledger + this process's unwritten events."""
        start, end = month_bounds(when or self.clock())
        key = (tenant_id, start)
        hit = self._ledger.get(key)
        if hit is None or hit[0] <= self._now_s():
            try:
                hit = await self._ledger_reads.run(key, lambda: self._read_ledger(key, end))
            except Exception as exc:
                stale = _stale(hit, exc)
                hit = (self._now_s() + self.ledger_ttl_s, stale[1] + self._ingested[key] - stale[2],
                       self._ingested[key])
                self._ledger[key] = hit
        _, total, marker = hit
        return total + (self._ingested[key] - marker) + self.sink.pending_tokens(tenant_id, start, end)

    async def _read_ledger(self, key: tuple[str, datetime], end: datetime) -> tuple[float, int, int]:
        marker = self._ingested[key]
        total = await tokens_used(self.sessions, key[0], key[1], end)
        # ingested-since counts only what lands after this load; a commit racing the load is
        # counted twice until the entry expires (errs on the side of the quota)
        hit = (self._now_s() + self.ledger_ttl_s, total, marker)
        self._ledger[key] = hit
        return hit

    # ---- QuotaGate --------------------------------------------------------------------------------

    async def reserve(self, principal: Principal, estimated_tokens: int,
                      at_least: int | None = None) -> Reservation | None:
        """Reserve ``estimated_tokens``, or with ``at_least`` (a request on the default budget) what is left, down
        to ``at_least``: ``Reservation.tokens`` says how many were granted."""
        quota = await self.quota_of(principal.tenant_id)
        if quota is None:
            return None
        now = self.clock()
        start, _ = month_bounds(now)
        used = await self.used(principal.tenant_id, now)
        # no await from here on: check and reserve are one step
        taken = used + self.reserved_tokens(principal.tenant_id, through=start)
        grant = estimated_tokens
        if at_least is not None:
            grant = max(min(estimated_tokens, quota - taken), at_least)
        if taken + grant > quota:
            raise insufficient_quota(quota, taken, grant, default_budget=at_least is not None)
        months = self._reserved.setdefault(principal.tenant_id, {})
        months[start] = months.get(start, 0) + grant
        return Reservation(principal.tenant_id, start, grant)

    def reserved_tokens(self, tenant_id: str, through: datetime | None = None) -> int:
        """What ``tenant_id``'s running requests reserved, admitted in ``through`` or an earlier month (default: any).
        A request is billed when it ends, so one admitted late last month and still running lands in this month's
        tokens."""
        return sum(tokens for month, tokens in self._reserved.get(tenant_id, {}).items()
                   if through is None or month <= through)

    def release(self, reservation: Reservation | None) -> None:
        if reservation is None:
            return
        months = self._reserved.get(reservation.tenant_id, {})
        left = months.get(reservation.month, 0) - reservation.tokens
        assert left >= 0, "quota reservation released twice"
        months[reservation.month] = left
        if not left:
            del months[reservation.month]
            if not months:
                del self._reserved[reservation.tenant_id]
