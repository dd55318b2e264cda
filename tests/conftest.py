"""Shared fixtures: markers by directory, real-service checks, and a tiny model built once per run."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
POSTGRES_HOSTPORT = ("127.0.0.1", 5432)
REDIS_HOSTPORT = ("127.0.0.1", 6379)
POSTGRES_URL = os.environ.get("LORAPLEX_TEST_DATABASE_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("LORAPLEX_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")

_DIR_MARKERS = {"unit": "unit", "integration": "integration", "e2e": "e2e", "gpu": "gpu"}


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


# Triton chooses its CPU interpreter once, when first imported: without CUDA, set it before any test
# module (a kernel unit test, or a GPU test module collected and then skipped) imports triton.
if not _cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    has_cuda = _cuda_available()
    skip_gpu = pytest.mark.skip(reason="needs CUDA (gpu marker): run tests/gpu on a GPU machine")
    for item in items:
        parts = Path(str(item.fspath)).relative_to(ROOT).parts
        if len(parts) > 1 and parts[0] == "tests" and parts[1] in _DIR_MARKERS:
            item.add_marker(getattr(pytest.mark, _DIR_MARKERS[parts[1]]))
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)


def _reachable(hostport: tuple[str, int]) -> bool:
    try:
        with socket.create_connection(hostport, timeout=1.0):
            return True
    except OSError:
        return False


def require_service(name: str, hostport: tuple[str, int]) -> None:
    """Skip (visibly) when a real service is unreachable; under CI=true its absence fails the run."""
    if _reachable(hostport):
        return
    msg = f"{name} is not reachable at {hostport[0]}:{hostport[1]}"
    if IN_CI:
        pytest.fail(f"{msg} (CI=true: integration services are required)")
    pytest.skip(msg)


@pytest.fixture(scope="session")
def postgres_url() -> str:
    require_service("PostgreSQL", POSTGRES_HOSTPORT)
    return POSTGRES_URL


@pytest.fixture(scope="session")
def redis_url() -> str:
    require_service("Redis", REDIS_HOSTPORT)
    return REDIS_URL


# ---- tiny models, built once per test run ------------------------------------------------------

MIXED_TARGETS = (
    ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    ("q_proj", "v_proj"),
    ("o_proj", "down_proj", "up_proj"),
    ("k_proj", "gate_proj"),
)


def _build(tmp_path_factory, name: str, **kw):
    from loraplex.demo import DemoModelSpec, build_demo_model

    out = tmp_path_factory.mktemp(name)
    spec = DemoModelSpec(**kw)
    return build_demo_model(out, spec)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> dict:
    """Llama-3 style (GQA 4:2, llama3 rope scaling) with 6 adapters of mixed ranks and target sets.

    Returns the manifest: {"model_dir", "adapters": [{"name","rank","target_modules"}...]};
    adapter directories are ``<model_dir>/adapters/<name>``.
    """
    return _build(
        tmp_path_factory, "tiny-llama", arch="llama", rope_scaling="llama3", adapters=6,
        adapter_ranks=(8, 16, 4, 32, 12, 64), adapter_targets=MIXED_TARGETS, seed=1,
    )


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> dict:
    """Qwen2 style (qkv bias), MQA (4 query heads, 1 KV head), 2 adapters."""
    return _build(tmp_path_factory, "tiny-qwen2", arch="qwen2", heads=4, kv_heads=1, adapters=2, seed=2)


def adapter_dir(manifest: dict, index: int) -> str:
    return str(Path(manifest["model_dir"]) / "adapters" / manifest["adapters"][index]["name"])


def nan_adapter(manifest: dict, index: int, dest: Path, weight: str = "lora_B") -> Path:
    """A copy of adapter ``index`` at ``dest`` with one NaN in its first ``<weight>.weight`` tensor: a file
    that reads fine and that validation must refuse."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(adapter_dir(manifest, index), dest)
    weights = dest / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    tensors[next(n for n in tensors if n.endswith(f"{weight}.weight"))][0, 0] = float("nan")
    save_file(tensors, str(weights))
    return dest


def dequantized_copy(src, dst, method: str = "int8") -> Path:
    """A copy of the model at ``src`` in ``dst`` whose projection weights are their weight-only round trip through
    ``method`` (int8 or fp8; float32 on disk): what ``quantization=method`` computes with, as a plain checkpoint."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from loraplex.engine.quant import QUANTIZERS

    src, dst = Path(src), Path(dst)
    for f in src.iterdir():
        if f.is_file():
            shutil.copy(f, dst / f.name)
    for f in src.glob("*.safetensors"):
        tensors = load_file(str(f))
        for name, t in tensors.items():
            if name.endswith("_proj.weight"):
                tensors[name] = QUANTIZERS[method](t.float()).dequantize(torch.float32)
        save_file(tensors, str(dst / f.name), metadata={"format": "pt"})
    return dst
