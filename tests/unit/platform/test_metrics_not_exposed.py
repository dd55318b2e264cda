"""``/metrics`` names tenants and running adapters, so the ingress in deploy/k8s must not route it (SECURITY.md 27).

The app also answers ``/metrics/`` (Litestar ignores a trailing slash) and ``//metrics``; nginx matches the
ingress paths on the normalised URI (percent-decoded, slashes merged) and forwards the request as sent. No
spelling the app serves may match one of the ingress' paths (Exact, or Kubernetes' element-wise Prefix)."""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from urllib.parse import unquote

import pytest
import yaml
from litestar.testing import TestClient

from loraplex.platform.app import create_app
from loraplex.settings import Settings

DEPLOYMENT = Path(__file__).resolve().parents[3] / "deploy" / "k8s" / "deployment.yaml"
SPELLINGS = ["/metrics", "/metrics/", "/metrics//", "//metrics", "/metrics%2F", "/metrics/?x=1", "/metrics?x=1",
             "/%6detrics", "/metrics/."]


def _nginx_uri(raw: str) -> str:
    """What nginx matches locations against: no query, percent-decoded, '//' merged, dot segments resolved."""
    path = unquote(raw.split("?", 1)[0])
    path = re.sub(r"/{2,}", "/", path)
    normal = posixpath.normpath(path)
    return normal + "/" if path.endswith("/") and normal != "/" else normal


def _routes() -> list[tuple[str, str]]:
    """(pathType, path) of every ingress rule."""
    docs = [d for d in yaml.safe_load_all(DEPLOYMENT.read_text()) if d and d.get("kind") == "Ingress"]
    return [(p["pathType"], p["path"]) for d in docs for rule in d["spec"]["rules"] for p in rule["http"]["paths"]]


def _routed(uri: str, routes: list[tuple[str, str]]) -> bool:
    parts = [x for x in uri.split("/") if x]
    for kind, path in routes:
        want = [x for x in path.split("/") if x]
        if (uri == path) if kind == "Exact" else parts[:len(want)] == want:
            return True
    return False


def test_no_spelling_of_metrics_the_app_serves_is_routed_by_the_ingress(tmp_path):
    routes = _routes()
    assert routes, "the ingress routes nothing"
    app = create_app(Settings(data_dir=str(tmp_path)), start_engine=False)
    with TestClient(app) as client:
        served = [raw for raw in SPELLINGS
                  if (r := client.get(raw)).status_code == 200 and "loraplex_" in r.text]
        assert "/metrics" in served and client.get("/v1/models").status_code == 401
    leaks = [raw for raw in served if _routed(_nginx_uri(raw), routes)]
    assert leaks == [], f"the app serves metrics at {leaks}, which the ingress forwards"
    assert _routed("/v1/models", routes) and _routed("/health", routes)
    assert not _routed("/", routes)  # a catch-all prefix would forward /metrics too


@pytest.mark.parametrize("raw, uri", [("/metrics//", "/metrics/"), ("//metrics?x=1", "/metrics"),
                                      ("/%6detrics%2F", "/metrics/"), ("/a/../metrics", "/metrics")])
def test_nginx_normalisation_model(raw, uri):
    assert _nginx_uri(raw) == uri


TOKEN = "m" * 12 + "-scrape-token"


def test_with_a_metrics_token_only_that_bearer_token_reads_metrics(tmp_path):
    """LORAPLEX_METRICS_TOKEN: for deployments where /metrics is reachable from outside. Tenant and admin API keys
    do not open it; every spelling the app serves asks for the token."""
    settings = Settings.from_env({"LORAPLEX_METRICS_TOKEN": TOKEN}, data_dir=str(tmp_path))
    keys: list[str] = []
    app = create_app(settings, start_engine=False, on_bootstrap_key=keys.append)
    with TestClient(app) as client:
        asked = 0
        for raw in SPELLINGS:  # spellings the app does not serve stay 404s
            r = client.get(raw)
            assert r.status_code in (401, 404) and "loraplex_" not in r.text, raw
            if r.status_code == 401:
                assert r.json()["error"]["code"] == "invalid_metrics_token" and r.headers["www-authenticate"]
                asked += 1
        assert asked >= 3
        for header in (f"Bearer {TOKEN}x", f"Basic {TOKEN}", TOKEN, f"Bearer {keys[0]}", "Bearer "):
            r = client.get("/metrics", headers={"Authorization": header})
            assert r.status_code == 401, header
        r = client.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 200 and "loraplex_" in r.text
        assert client.get("/health").status_code == 200  # the probes stay open


def test_serve_refuses_a_short_metrics_token_and_warns_when_metrics_are_open_beyond_loopback(tmp_path, caplog):
    from loraplex.platform.cli import FlagError
    from loraplex.platform.cli_serve import check_serve_settings, is_loopback, warn_open_metrics

    with pytest.raises(FlagError, match="LORAPLEX_METRICS_TOKEN must be at least 16 characters, got 5"):
        check_serve_settings(Settings(metrics_token="short"))
    check_serve_settings(Settings(metrics_token=TOKEN))
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("api.example.com")
    with caplog.at_level("WARNING", logger="loraplex.platform.cli_serve"):
        assert not warn_open_metrics(Settings(host="127.0.0.1"))
        assert not warn_open_metrics(Settings(host="0.0.0.0", metrics_token=TOKEN))
        assert caplog.records == []
        assert warn_open_metrics(Settings(host="0.0.0.0", port=8123))
    assert "0.0.0.0:8123" in caplog.text and "LORAPLEX_METRICS_TOKEN" in caplog.text
