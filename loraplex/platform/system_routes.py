"""Probes and metrics: ``/health`` (liveness), ``/ready`` (readiness), ``/metrics`` (Prometheus)."""

from __future__ import annotations

import asyncio
import hmac
import logging

import msgspec
from litestar import Request, Response, get
from litestar.openapi.datastructures import ResponseSpec

from loraplex.platform.auth import authorization_bearer
from loraplex.platform.engine_boot import engine_silent_s
from loraplex.platform.errors import ApiError
from loraplex.platform.metrics import CONTENT_TYPE

log = logging.getLogger(__name__)

DB_PROBE_TIMEOUT_S = 2.0  # below the readiness probe's timeoutSeconds (deploy/k8s/deployment.yaml)


class HealthStatus(msgspec.Struct):
    status: str


class ReadyStatus(msgspec.Struct):
    status: str  # "ready" | "draining" | "database_unavailable" | "loading" | "engine_dead" | "engine_failed" |
    # "engine_stalled"
    engine: bool
    draining: bool
    detail: str | None = None


@get("/health", summary="Liveness", tags=["system"], include_in_schema=True)
async def health() -> HealthStatus:
    """The process is up (the engine may still be loading: see ``/ready``)."""
    return HealthStatus(status="ok")


@get("/ready", summary="Readiness", tags=["system"],
     responses={503: ResponseSpec(data_container=ReadyStatus, description="Not ready")})
async def ready(request: Request) -> Response[ReadyStatus]:
    """200 when this replica takes traffic; 503 while loading, draining, without its database, or after
    the engine died."""
    services = request.app.state.services
    if services.draining:
        body = ReadyStatus(status="draining", engine=services.engine_ready, draining=True)
    elif (db_error := await _database_error(services)) is not None:
        body = ReadyStatus(status="database_unavailable", engine=services.engine_ready, draining=False,
                           detail=db_error)
    elif services.engine_error:
        body = ReadyStatus(status="engine_failed", engine=False, draining=False, detail=services.engine_error)
    elif services.engine is None:
        body = ReadyStatus(status="loading", engine=False, draining=False)
    elif not services.engine.is_healthy():
        body = ReadyStatus(status="engine_dead", engine=False, draining=False)
    elif (stalled := _engine_stalled(services)) is not None:
        body = ReadyStatus(status="engine_stalled", engine=False, draining=False, detail=stalled)
    else:
        return Response(ReadyStatus(status="ready", engine=True, draining=False))
    return Response(body, status_code=503, headers={"Retry-After": "1"})


def _engine_stalled(services) -> str | None:
    """A reason when the engine process has sent nothing for a quarter of ``engine_stall_timeout_s`` (it beats every
    second when idle): out of rotation while it may still recover; the supervisor kills it at the full timeout."""
    stall = services.settings.engine_stall_timeout_s
    silent = engine_silent_s(services.engine)
    if stall and silent > stall / 4:
        return f"nothing from the engine for {silent:.0f} s (it is replaced after {stall:g} s)"
    return None


async def _database_error(services) -> str | None:
    """None when ``SELECT 1`` answers in time; else a short reason (every request would fail with 503)."""
    from sqlalchemy import text

    async def probe() -> None:
        async with services.db.connect() as conn:
            await conn.execute(text("SELECT 1"))

    try:
        await asyncio.wait_for(probe(), DB_PROBE_TIMEOUT_S)
    except asyncio.TimeoutError:
        return f"no answer within {DB_PROBE_TIMEOUT_S:.0f} s"
    except Exception as exc:  # noqa: BLE001 (any failure to reach it means: not ready)
        log.warning("readiness: database unavailable: %s", exc)
        return type(exc).__name__
    return None


@get("/metrics", summary="Prometheus metrics", tags=["system"], media_type=CONTENT_TYPE)
async def metrics(request: Request) -> Response[bytes]:
    """Prometheus text. With ``LORAPLEX_METRICS_TOKEN`` set, only for ``Authorization: Bearer <that token>``
    (tenant API keys do not open it: it names every tenant and adapter)."""
    services = request.app.state.services
    token = services.settings.metrics_token
    if token:
        sent = authorization_bearer(request.headers.get("authorization"))
        if sent is None or not hmac.compare_digest(sent.encode(), token.encode()):
            raise ApiError(401, "/metrics needs the metrics token (LORAPLEX_METRICS_TOKEN) as a bearer token.",
                           param="authorization", code="invalid_metrics_token",
                           headers={"WWW-Authenticate": 'Bearer realm="metrics"'})
    return Response(services.metrics.render(), media_type=CONTENT_TYPE)


def route_handlers() -> list:
    return [health, ready, metrics]
