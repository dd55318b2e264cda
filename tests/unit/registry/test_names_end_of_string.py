"""Names are plain tokens to their last character: a trailing newline (which a regex's ``$`` lets through) is
refused like any other character outside the name's alphabet."""

from __future__ import annotations

import pytest

from loraplex.platform.middleware import _incoming_id
from loraplex.platform.registry.names import parse_model_name
from tests.unit.registry.conftest import adapter_files


@pytest.mark.parametrize("model", ["tuned\n", "alice\n/tuned", "alice/tuned\n", "tuned\n@1"])
def test_a_model_string_with_a_trailing_newline_names_no_adapter(model):
    assert parse_model_name(model) is None


def test_a_request_id_with_a_trailing_newline_is_replaced():
    assert _incoming_id({"headers": [(b"x-request-id", b"trace-1")]}) == "trace-1"
    assert _incoming_id({"headers": [(b"x-request-id", b"trace-1\n")]}) is None


async def test_names_with_a_trailing_newline_are_refused(rapp, tiny_model):
    alice = await rapp.tenant("alice")
    config, weights = adapter_files(tiny_model, 1)
    r = await rapp.upload(alice, "tuned\n", config=config, weights=weights)
    assert r.status_code == 400 and r.json()["error"]["param"] == "name", r.text
    r = await rapp.client.post("/admin/tenants", json={"name": "bob\n"}, headers=rapp.headers())
    assert r.status_code == 400 and r.json()["error"]["param"] == "name", r.text
    r = await rapp.client.get("/v1/adapters", headers=rapp.headers(alice))
    assert r.json()["data"] == []
    r = await rapp.client.get("/admin/tenants", headers=rapp.headers())
    assert "bob\n" not in {t["name"] for t in r.json()["data"]}
