"""``/metrics`` names tenants and running adapters, so the ingress in deploy/k8s must block it (SECURITY.md 27).

The app also answers ``/metrics/`` (Litestar ignores a trailing slash) and ``//metrics``; nginx matches
locations on the normalised URI (percent-decoded, slashes merged) and forwards the request as sent. Every
spelling the app serves must hit one of the ingress' blocking locations."""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from urllib.parse import unquote

import pytest
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


def _blocked(uri: str, rules: list[tuple[str, str]]) -> bool:
    return any(uri == path if kind == "=" else uri.startswith(path) for kind, path in rules)


def test_every_spelling_of_metrics_the_app_serves_is_blocked_by_the_ingress(tmp_path):
    rules = re.findall(r"location\s+(=|\^~)\s+(\S+)\s*\{\s*return 404;\s*\}", DEPLOYMENT.read_text())
    assert rules, "the ingress blocks no location"
    app = create_app(Settings(data_dir=str(tmp_path)), start_engine=False)
    with TestClient(app) as client:
        served = [raw for raw in SPELLINGS
                  if (r := client.get(raw)).status_code == 200 and "loraplex_" in r.text]
        assert "/metrics" in served and client.get("/v1/models").status_code == 401
    leaks = [raw for raw in served if not _blocked(_nginx_uri(raw), rules)]
    assert leaks == [], f"the app serves metrics at {leaks}, which the ingress forwards"
    assert not _blocked("/v1/models", rules) and not _blocked("/health", rules)


@pytest.mark.parametrize("raw, uri", [("/metrics//", "/metrics/"), ("//metrics?x=1", "/metrics"),
                                      ("/%6detrics%2F", "/metrics/"), ("/a/../metrics", "/metrics")])
def test_nginx_normalisation_model(raw, uri):
    assert _nginx_uri(raw) == uri
