"""``/v1/adapters``: upload (multipart), list, get, edit, delete; and the registry's start-up wiring.

Handlers are thin: the service checks ownership (another tenant's adapter is a 404, like a missing one)."""

from __future__ import annotations

from litestar import Request, Response, delete, get, patch, post
from litestar.params import Parameter

from loraplex.platform import idempotency
from loraplex.platform.auth import principal_of, require_scope
from loraplex.platform.errors import bad_request, error_responses, not_found
from loraplex.platform.models import SCOPE_ADAPTERS_WRITE
from loraplex.platform.registry import queries
from loraplex.platform.registry.names import parse_own_name
from loraplex.platform.registry.schemas import (
    AdapterDeleted,
    AdapterList,
    AdapterOut,
    AdapterPatch,
    adapter_out,
)
from loraplex.platform.registry.setup import registry_of, setup, teardown

_WRITE = [require_scope(SCOPE_ADAPTERS_WRITE)]
_READ = [require_scope()]  # any valid key
_NAME = Parameter(max_length=160, pattern=r"^[a-z0-9][a-z0-9._-]{0,63}(@[1-9][0-9]{0,9})?$",
                  description="<name> or <name>@<version>, in the caller's tenant")


@post("/v1/adapters", guards=_WRITE, status_code=201, request_max_body_size=None, tags=["adapters"],
      summary="Upload an adapter (multipart/form-data)",
      responses=error_responses(400, 401, 403, 408, 409, 413, 415, 422, 503))
async def upload_adapter(request: Request,
                         idempotency_key: str | None = idempotency.KEY_PARAMETER) -> Response[AdapterOut]:
    """Fields: ``name``; optional ``description``, ``visibility`` (private | shared | public, admins only) and
    ``shared_with`` (tenant names, repeated or comma-separated); files: ``archive`` (.tar.gz or .zip) or
    ``config`` (adapter_config.json) + ``weights`` (adapter_model.safetensors)."""
    registry = registry_of(request)

    async def run() -> Response[AdapterOut]:
        principal = await principal_of(request)
        pending, listed = await registry.upload(request, principal)
        return Response(adapter_out(listed, principal.tenant_id, version=pending.version), status_code=201)

    return await idempotency.upload_route(request, idempotency_key, "adapters", registry.max_upload_bytes, run)


@get("/v1/adapters", guards=_READ, tags=["adapters"], summary="List adapters you own or may use",
     responses=error_responses(401))
async def list_adapters(request: Request) -> AdapterList:
    principal = await principal_of(request)
    async with request.app.state.services.sessions() as session:
        items = await queries.list_usable(session, principal)
    return AdapterList(data=[adapter_out(i, principal.tenant_id) for i in items])


@get("/v1/adapters/{name:str}", guards=_READ, tags=["adapters"], summary="Get one of your adapters",
     responses=error_responses(400, 401, 404))
async def get_adapter(request: Request, name: str = _NAME) -> AdapterOut:
    principal = await principal_of(request)
    adapter_name, version = parse_own_name(name)
    async with request.app.state.services.sessions() as session:
        item = await queries.get_own(session, principal.tenant_id, adapter_name)
    if item is None:
        raise not_found(f"No adapter '{adapter_name}'.", param="name")
    if version is None:
        return adapter_out(item, principal.tenant_id)
    if not any(v.version == version for v in item.versions):
        raise not_found(f"No version {version} of adapter '{adapter_name}'.", param="name")
    # the adapter's own fields (status, latest_version) stay the adapter's; only its versions list is narrowed
    out = adapter_out(item, principal.tenant_id, version=version)
    out.versions = [v for v in out.versions if v.version == version]
    return out


@patch("/v1/adapters/{name:str}", guards=_WRITE, tags=["adapters"], summary="Edit description or sharing",
       responses=error_responses(400, 401, 403, 404))
async def update_adapter(request: Request, data: AdapterPatch, name: str = _NAME) -> AdapterOut:
    principal = await principal_of(request)
    adapter_name, version = parse_own_name(name)
    if version is not None:  # decided by the path alone: says nothing of whether the adapter exists
        raise bad_request(f"Adapter versions are immutable: '{name}' names version {version}. Edit the adapter "
                          f"instead (PATCH /v1/adapters/{adapter_name}); its description and sharing apply to "
                          "every version.", param="name")
    registry = registry_of(request)
    meta = await registry.check_metadata(principal, data.description, data.visibility, data.shared_with)
    return adapter_out(await registry.update(principal, adapter_name, meta), principal.tenant_id)


@delete("/v1/adapters/{name:str}", guards=_WRITE, status_code=200, tags=["adapters"],
        summary="Delete an adapter (or one version with name@N)", responses=error_responses(400, 401, 403, 404))
async def delete_adapter(request: Request, name: str = _NAME) -> AdapterDeleted:
    principal = await principal_of(request)
    adapter_name, version = parse_own_name(name)
    await registry_of(request).delete(principal, adapter_name, version)
    return AdapterDeleted(id=name)


def route_handlers() -> list:
    return [upload_adapter, list_adapters, get_adapter, update_adapter, delete_adapter]


__all__ = ["route_handlers", "setup", "teardown"]
