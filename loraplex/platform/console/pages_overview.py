"""Overview: live engine state, refreshed by the page itself (a polled HTML fragment)."""

from __future__ import annotations

from dataclasses import dataclass, field

from litestar import Request, Response, get

from loraplex.platform import tenants as tenant_svc
from loraplex.platform.console import billing
from loraplex.platform.console.deps import session_of
from loraplex.platform.console.render import fragment, page
from loraplex.platform.console.session import Session

REFRESH_MS = 2000


@dataclass
class EngineView:
    state: str  # "running" | "loading" | "failed" | "unhealthy"
    detail: str = ""
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_pct: float = 0.0
    kv_cache_note: str = ""  # e.g. "of 4,096 blocks, float8_e4m3fn"
    prefix_hit_pct: float = 0.0
    tokens_per_second: float = 0.0
    num_preemptions: int = 0
    num_lora_loads: int = 0
    num_lora_evictions: int = 0
    max_loras: int = 0
    num_resident: int = 0
    resident: list[str] = field(default_factory=list)  # names this viewer may see
    hidden_resident: int = 0  # resident adapters of other tenants (counted, not named)
    spec_draft_tokens: int = 0  # speculative decoding (LORAPLEX_NUM_SPECULATIVE_TOKENS): drafts verified
    spec_accepted_tokens: int = 0


def engine_view(request: Request, session: Session) -> EngineView:
    services = request.app.state.services
    engine = services.engine
    if engine is None:
        if services.engine_error:
            return EngineView("failed", services.engine_error if session.principal.is_admin else "")
        return EngineView("loading", "The model is loading; inference starts when it is ready.")
    stats = engine.stats()
    names = list(stats.active_adapters)
    visible = names if session.principal.is_admin else [n for n in names if _owned(n, session)]
    return EngineView(
        state="running" if engine.is_healthy() else "unhealthy",
        num_running=stats.num_running, num_waiting=stats.num_waiting,
        kv_cache_pct=100.0 * stats.kv_cache_usage,
        kv_cache_note=f"of {stats.num_kv_blocks:,} blocks, {stats.kv_cache_dtype}" if stats.num_kv_blocks else "",
        prefix_hit_pct=100.0 * stats.prefix_cache_hit_rate,
        tokens_per_second=stats.tokens_per_second, num_preemptions=stats.num_preemptions,
        num_lora_loads=stats.num_lora_loads, num_lora_evictions=stats.num_lora_evictions,
        max_loras=services.settings.max_loras, num_resident=len(names), resident=visible,
        hidden_resident=len(names) - len(visible),
        spec_draft_tokens=stats.spec_draft_tokens, spec_accepted_tokens=stats.spec_accepted_tokens,
    )


def _owned(engine_name: str, session: Session) -> bool:
    # the registry names engine adapters "<tenant>/<adapter>" (never paths); a tenant sees its own only
    return engine_name.startswith(session.principal.tenant_name + "/")


@get("/", include_in_schema=False)
async def overview(request: Request) -> Response:
    session = await session_of(request)
    services = request.app.state.services
    plan = None
    if not session.principal.is_admin:  # a tenant also sees where it stands this month
        async with services.sessions() as s:
            tenant = await tenant_svc.get_tenant(s, session.principal.tenant_id)
        plan = await billing.tenant_plan(services, tenant)
    return page(request, "overview.html", session, active="overview", engine=engine_view(request, session),
                base_model=services.base_model_id, refresh_ms=REFRESH_MS, plan=plan)


@get("/overview/engine", include_in_schema=False)
async def engine_fragment(request: Request) -> Response:
    session = await session_of(request)
    return fragment("_engine.html", engine=engine_view(request, session))


def handlers() -> list:
    return [overview, engine_fragment]
