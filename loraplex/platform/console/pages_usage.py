"""Usage: tokens by day and by adapter (SVG bar charts), exports."""

from __future__ import annotations

from litestar import Request, Response, get

from loraplex.platform.console.deps import session_of
from loraplex.platform.console.render import page


@get("/usage", include_in_schema=False)
async def usage_page(request: Request) -> Response:
    session = await session_of(request)
    return page(request, "usage.html", session, active="usage", report=None)


def handlers() -> list:
    return [usage_page]
