"""The tenant workflow against a live ``loraplex serve``: ``loraplex adapter upload`` (a directory and an
archive), call the adapter, ``list``, ``delete`` (then the model is gone)."""

from __future__ import annotations

import tarfile

import pytest

from tests.conftest import adapter_dir
from tests.e2e.server import start_server


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model):
    srv = start_server(tmp_path_factory.mktemp("registry-srv"), model=tiny_model["model_dir"],
                       env={"LORAPLEX_NUM_KV_BLOCKS": "256", "LORAPLEX_MAX_MODEL_LEN": "512"})
    yield srv
    assert srv.stop() == 0


def _cli(server, key, *args):
    env_before = dict(server.env)
    server.env["LORAPLEX_API_KEY"] = key
    try:
        return server.cli("adapter", *args, "--url", server.base_url)
    finally:
        server.env.clear()
        server.env.update(env_before)


def test_cli_upload_call_list_delete(server, tiny_model, tmp_path):
    acme = server.create_tenant("acme", scopes=["inference", "adapters:write"])["key"]
    out = _cli(server, acme, "upload", "helper", adapter_dir(tiny_model, 1), "--description", "first try")
    assert out.returncode == 0, out.stderr
    assert "uploaded helper version 1" in out.stdout

    archive = tmp_path / "helper.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(adapter_dir(tiny_model, 2), arcname="helper")
    out = _cli(server, acme, "upload", "helper", str(archive))
    assert out.returncode == 0 and "version 2" in out.stdout, out.stderr

    with server.client(acme) as c:
        for model in ("helper", "helper@1", "acme/helper@2"):
            r = c.post("/v1/chat/completions", json={
                "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
            assert r.status_code == 200, r.text
            assert r.json()["model"] == model
        assert "helper" in {m["id"] for m in c.get("/v1/models").json()["data"]}

    out = _cli(server, acme, "list")
    assert out.returncode == 0
    row = next(line for line in out.stdout.splitlines() if line.startswith("helper"))
    assert row.split()[:3] == ["helper", "2", "ready"]

    pickle_dir = tmp_path / "pickled"
    pickle_dir.mkdir()
    (pickle_dir / "adapter_config.json").write_text("{}")
    (pickle_dir / "adapter_model.bin").write_bytes(b"\x80\x04K\x01.")
    out = _cli(server, acme, "upload", "bad", str(pickle_dir))
    assert out.returncode == 1 and "only safetensors" in out.stderr

    out = _cli(server, acme, "delete", "helper")
    assert out.returncode == 0 and "deleted helper" in out.stdout
    with server.client(acme) as c:
        r = c.post("/v1/chat/completions", json={"model": "helper", "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 404
    out = _cli(server, acme, "delete", "helper")
    assert out.returncode == 1 and "HTTP 404" in out.stderr
