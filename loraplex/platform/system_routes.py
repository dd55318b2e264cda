"""Probes and metrics: ``/health`` (liveness), ``/ready`` (readiness), ``/metrics`` (Prometheus)."""

from __future__ import annotations

import msgspec
from litestar import Request, Response, get
from litestar.openapi.datastructures import ResponseSpec

from loraplex.platform.metrics import CONTENT_TYPE


class HealthStatus(msgspec.Struct):
    status: str


class ReadyStatus(msgspec.Struct):
    status: str  # "ready" | "draining" | "loading" | "engine_dead" | "engine_failed"
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
    """200 when this replica takes traffic; 503 while loading, draining, or after the engine died."""
    services = request.app.state.services
    if services.draining:
        body = ReadyStatus(status="draining", engine=services.engine_ready, draining=True)
    elif services.engine_error:
        body = ReadyStatus(status="engine_failed", engine=False, draining=False, detail=services.engine_error)
    elif services.engine is None:
        body = ReadyStatus(status="loading", engine=False, draining=False)
    elif not services.engine.is_healthy():
        body = ReadyStatus(status="engine_dead", engine=False, draining=False)
    else:
        return Response(ReadyStatus(status="ready", engine=True, draining=False))
    return Response(body, status_code=503, headers={"Retry-After": "1"})


@get("/metrics", summary="Prometheus metrics", tags=["system"], media_type=CONTENT_TYPE)
async def metrics(request: Request) -> Response[bytes]:
    return Response(request.app.state.services.metrics.render(), media_type=CONTENT_TYPE)


def route_handlers() -> list:
    return [health, ready, metrics]
