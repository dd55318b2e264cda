"""Registry test helpers: an in-process app on SQLite (engine optional), tenants with keys, uploads."""

from __future__ import annotations

import contextlib
import io
import json
import tarfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from litestar.testing import AsyncTestClient

from loraplex.platform.app import create_app
from loraplex.settings import Settings
from tests.conftest import adapter_dir

UPLOAD_LIMIT = 16 << 20  # small enough that oversized bodies are cheap to build


@dataclass
class RegistryApp:
    client: AsyncTestClient
    admin_key: str
    data_dir: Path
    app: object

    @property
    def services(self):
        return self.app.state.services

    def headers(self, key: str | None = None) -> dict:
        return {"Authorization": f"Bearer {key or self.admin_key}"}

    async def tenant(self, name: str, scopes=("inference", "adapters:write")) -> str:
        h = self.headers()
        r = await self.client.post("/admin/tenants", json={"name": name}, headers=h)
        assert r.status_code in (200, 201), r.text
        r = await self.client.post("/admin/keys", json={"tenant": name, "scopes": list(scopes)}, headers=h)
        assert r.status_code in (200, 201), r.text
        return r.json()["key"]

    async def upload(self, key: str | None, name: str | None, *, config: bytes | None = None,
                     weights: bytes | None = None, archive: bytes | None = None, weights_filename: str =
                     "adapter_model.safetensors", **fields):
        data = {k: v for k, v in fields.items() if v is not None}
        if name is not None:
            data["name"] = name
        files = {}
        if config is not None:
            files["config"] = ("adapter_config.json", config, "application/json")
        if weights is not None:
            files["weights"] = (weights_filename, weights, "application/octet-stream")
        if archive is not None:
            files["archive"] = ("adapter.tar.gz", archive, "application/octet-stream")
        return await self.client.post("/v1/adapters", data=data, files=files, headers=self.headers(key))

    def store_digests(self) -> set[str]:
        root = self.data_dir / "adapters" / "store"
        return {p.name for p in root.glob("??/*")} if root.exists() else set()

    def tmp_entries(self) -> list[Path]:
        root = self.data_dir / "adapters" / "tmp"
        return list(root.iterdir()) if root.exists() else []


@contextlib.asynccontextmanager
async def registry_app(tmp_path: Path, model_dir: str, *, engine=None, **settings_kw):
    keys: list[str] = []
    settings = Settings(data_dir=str(tmp_path / "data"), model=model_dir, device="cpu",
                        max_upload_bytes=UPLOAD_LIMIT, **settings_kw)
    app = create_app(settings, engine_client=engine, start_engine=False, on_bootstrap_key=keys.append)
    async with AsyncTestClient(app, timeout=60) as client:
        yield RegistryApp(client, keys[0], Path(settings.data_dir), app)


@pytest.fixture
async def rapp(tmp_path, tiny_model):
    async with registry_app(tmp_path, tiny_model["model_dir"], max_lora_rank=32) as ra:
        yield ra


def adapter_files(manifest: dict, index: int) -> tuple[bytes, bytes]:
    d = Path(adapter_dir(manifest, index))
    return (d / "adapter_config.json").read_bytes(), (d / "adapter_model.safetensors").read_bytes()


def tar_gz(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def config_with(config: bytes, **changes) -> bytes:
    cfg = json.loads(config)
    cfg.update(changes)
    return json.dumps(cfg).encode()
