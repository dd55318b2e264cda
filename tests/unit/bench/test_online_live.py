"""``loraplex bench online`` against a real ``loraplex serve`` (CPU, tiny model, one uploaded adapter)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loraplex.cli import main
from tests.conftest import adapter_dir
from tests.e2e.server import start_server


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model):
    srv = start_server(tmp_path_factory.mktemp("bench-srv"), model=tiny_model["model_dir"])
    yield srv
    srv.stop()


def _upload(srv, path: Path, name: str) -> str:
    with srv.client() as c:
        r = c.post("/v1/adapters", data={"name": name}, files={
            "config": ("adapter_config.json", (path / "adapter_config.json").read_bytes(), "application/json"),
            "weights": ("adapter_model.safetensors", (path / "adapter_model.safetensors").read_bytes(),
                        "application/octet-stream")})
        assert r.status_code == 201, r.text
        return r.json()["model"]


def test_online_bench_streams_every_request_and_reports_latencies(server, tiny_model, tmp_path):
    adapter = _upload(server, Path(adapter_dir(tiny_model, 0)), "bench-a0")
    with server.client() as c:
        base = c.get("/v1/models").json()["data"][0]["id"]
    rc = main(["bench", "online", "--url", server.base_url, "--api-key", server.admin_key, "--model", base,
               "--adapters", adapter, "--popularity", "uniform", "--rate", "50", "--num-requests", "6",
               "--input-len", "8", "--output-len", "5", "--vocab-size", "400", "--out-dir", str(tmp_path)])
    (json_path,) = tmp_path.glob("online-*.json")
    summary = json.loads(json_path.read_text())["summary"]
    assert rc == 0, summary["errors"]
    assert summary["completed"] == 6 and summary["failed"] == 0
    assert summary["output_tokens"] == 6 * 5  # ignore_eos honoured through the API
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        assert summary[key]["count"] > 0 and summary[key]["p50"] > 0
    assert summary["e2e_s"]["p99"] >= summary["ttft_s"]["p99"]
    md = next(tmp_path.glob("online-*.md")).read_text()
    assert "TTFT" in md and "goodput" in md
