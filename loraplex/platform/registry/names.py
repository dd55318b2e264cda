"""Adapter names and the ``model`` strings that name them.

``<adapter>`` is an adapter of the caller's tenant; ``<tenant>/<adapter>`` one of another tenant that is
shared with the caller or public; either may end in ``@<version>`` to pin a version (otherwise the latest
ready one). Names are plain tokens, so a model string can never smuggle a path into the store.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from loraplex.platform.errors import bad_request

ADAPTER_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}\Z")
_TENANT_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}\Z")
MAX_VERSION = 2**31 - 1


@dataclass(frozen=True)
class AdapterRef:
    tenant: str | None  # None: the caller's own tenant
    name: str
    version: int | None  # None: the latest ready version


def validate_adapter_name(name: str | None, param: str = "name") -> str:
    if name is None:
        raise bad_request(f"{param} is required: the adapter's name (1-64 characters of lowercase letters, digits, "
                          "'.', '_' or '-').", param=param)
    if not name or not ADAPTER_NAME_RE.match(name) or ".." in name:
        raise bad_request(
            "Adapter name must be 1-64 characters of lowercase letters, digits, '.', '_' or '-', starting with "
            "a letter or digit (no '/', '@' or '..').", param=param,
        )
    return name


def parse_model_name(model: str) -> AdapterRef | None:
    """The adapter a ``model`` string names, or None when it cannot name one (the caller answers 404)."""
    if not model or len(model) > 160:
        return None
    body, at, version_text = model.partition("@")
    version = None
    if at:
        if not version_text.isdigit() or version_text.startswith("0") or len(version_text) > 10:
            return None
        version = int(version_text)
        if version > MAX_VERSION:
            return None
    tenant, slash, name = body.rpartition("/")
    if slash and not _TENANT_RE.match(tenant):
        return None
    if not ADAPTER_NAME_RE.match(name) or ".." in name:
        return None
    return AdapterRef(tenant=tenant if slash else None, name=name, version=version)


def parse_own_name(value: str, param: str = "name") -> tuple[str, int | None]:
    """``name`` or ``name@N`` in a path of ``/v1/adapters/...`` (always the caller's own tenant)."""
    ref = parse_model_name(value)
    if ref is None or ref.tenant is not None:
        raise bad_request(f"'{value[:80]}' is not an adapter name (expected <name> or <name>@<version>).",
                          param=param)
    return ref.name, ref.version
