"""The platform app over a real engine on the tiny test model (CPU, float32, embedded default), in process."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from litestar import Litestar
from litestar.testing import TestClient

from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.config import served_model_id
from loraplex.platform.app import create_app
from loraplex.platform.engine_boot import engine_config
from loraplex.settings import Settings


def tiny_app(data_dir: Path, tiny_model: dict, **settings) -> tuple[Litestar, AsyncEngine, list[str], str]:
    """``(app, engine, keys, model id)``: the app over an in-process engine on the tiny model; ``keys`` gets the
    bootstrap admin key once the app has started. ``settings``: Settings fields over the defaults here."""
    settings = Settings(**{"data_dir": str(data_dir), "device": "cpu", "dtype": "float32",
                           "model": tiny_model["model_dir"], "num_kv_blocks": 512, **settings})
    model_id = served_model_id(tiny_model["model_dir"])
    engine = AsyncEngine.from_config(engine_config(settings, Path(tiny_model["model_dir"]), model_id))
    keys: list[str] = []
    return create_app(settings, engine_client=engine, on_bootstrap_key=keys.append), engine, keys, model_id


@contextlib.contextmanager
def tiny_app_client(data_dir: Path, tiny_model: dict, *, timeout: float = 60) -> Iterator[tuple[TestClient, str,
                                                                                                  Litestar]]:
    """``(client, model id, app)``: the client is signed in with the bootstrap admin key."""
    app, _, keys, model_id = tiny_app(data_dir, tiny_model)
    with TestClient(app, timeout=timeout) as client:
        client.headers["Authorization"] = f"Bearer {keys[0]}"
        yield client, model_id, app
