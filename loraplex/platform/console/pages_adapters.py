"""Adapters: list, upload (progress bar), validation status, visibility, delete."""

from __future__ import annotations

from litestar import Request, Response, get

from loraplex.platform.console.deps import session_of
from loraplex.platform.console.render import page


@get("/adapters", include_in_schema=False)
async def adapters_page(request: Request) -> Response:
    session = await session_of(request)
    return page(request, "adapters.html", session, active="adapters", adapters=None)


def handlers() -> list:
    return [adapters_page]
