"""Playground: stream a completion from the base model or one of the viewer's adapters.

The page lists the models the signed-in key may use (the platform's model resolver); the browser
streams from ``/console/api/v1/completions`` (see :mod:`proxy`), so a playground run is an ordinary
metered request of that key.
"""

from __future__ import annotations

from litestar import Request, Response, get

from loraplex.platform.console.deps import session_of
from loraplex.platform.console.render import page

DEFAULT_PROMPT = "Once upon a time"


@get("/playground", include_in_schema=False)
async def playground(request: Request) -> Response:
    session = await session_of(request)
    services = request.app.state.services
    models = await services.models.list_models(session.principal)
    chosen = request.query_params.get("model") or ""
    if chosen not in {m.name for m in models}:
        chosen = services.base_model_id
    return page(request, "playground.html", session, active="playground", models=models, chosen=chosen,
                base_model=services.base_model_id, default_prompt=DEFAULT_PROMPT,
                max_tokens_limit=services.settings.max_tokens_limit, engine_ready=services.engine_ready)


def handlers() -> list:
    return [playground]
