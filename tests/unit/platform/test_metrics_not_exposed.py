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
