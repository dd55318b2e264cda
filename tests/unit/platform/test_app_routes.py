"""The app's HTTP behaviour that needs no engine: error objects, request ids, draining, admin routes."""

from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone

import pytest
from litestar.testing import TestClient

from loraplex.platform.app import create_app
from loraplex.platform.auth import parse_key
from loraplex.settings import Settings


@pytest.fixture
def client(tmp_path):
    keys: list[str] = []
    app = create_app(Settings(data_dir=str(tmp_path)), start_engine=False, on_bootstrap_key=keys.append)
    with TestClient(app) as c:
        c.headers["Authorization"] = f"Bearer {keys[0]}"
        yield c


def test_error_objects_and_request_ids(client):
    for method, path, status in (("GET", "/nope", 404), ("PUT", "/health", 405),
                                 ("GET", "/admin/keys?tenant=a%00b", 404), ("DELETE", "/admin/keys/x%00y", 404)):
        r = client.request(method, path)
        assert r.status_code == status, path
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert r.headers["x-request-id"].startswith("req-")
    r = client.post("/admin/tenants", json={"name": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "name"


def test_malformed_bodies_and_names_get_messages_a_person_can_act_on(client):
    for body in (b'{"model": "x", "prompt": "Hello",', b"[1, 2"):
        r = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400
        assert r.json()["error"]["message"].startswith("JSON is malformed: the body ends before"), r.text
    r = client.get("/v1/adapters/conc@")
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "name"
    assert "name does not have the form the pattern" in err["message"] and "Expected `str`" not in err["message"]


def test_a_body_over_the_limit_is_a_413_that_names_the_limit(client):
    body = b'{"model": "m", "prompt": "' + b"x" * 10_000_001 + b'"}'
    for path in ("/v1/completions", "/admin/tenants"):
        r = client.post(path, content=body, headers={"content-type": "application/json"})
        assert r.status_code == 413, (path, r.text)
        err = r.json()["error"]
        assert err["code"] == "payload_too_large" and "10,000,000 bytes" in err["message"], err


def test_ready_reports_loading_without_engine_and_draining_refuses(client):
    r = client.get("/ready")
    assert r.status_code == 503 and r.json()["status"] == "loading"
    client.app.state.services.draining = True
    r = client.get("/admin/tenants")
    assert r.status_code == 503 and r.json()["error"]["code"] == "draining" and r.headers["retry-after"] == "1"
    assert client.get("/health").status_code == 200
    assert client.get("/ready").json()["status"] == "draining"


def test_inference_without_engine_is_a_fast_503(client):
    models = client.get("/v1/models").json()["data"]
    r = client.post("/v1/completions", json={"model": models[0]["id"], "prompt": "x"})
    assert r.status_code == 503 and r.headers["retry-after"]


def test_admin_tenant_and_key_lifecycle_ignores_body_smuggling(client):
    r = client.post("/admin/tenants", json={"name": "acme", "status": "suspended", "id": "0" * 32})
    assert r.status_code == 201 and r.json()["status"] == "active" and r.json()["id"] != "0" * 32
    r = client.post("/admin/keys", json={"tenant": "acme", "tenant_id": "other", "key_hash": "x"})
    assert r.status_code == 201 and r.json()["tenant"] == "acme" and r.json()["scopes"] == ["inference"]
    key = r.json()
    listed = client.get("/admin/keys", params={"tenant": "acme"}).json()["data"]
    assert [k["id"] for k in listed] == [key["id"]] and "key" not in listed[0] and "key_hash" not in listed[0]
    r = client.put("/admin/tenants/acme/limits", json={"requests_per_minute": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "requests_per_minute"
    assert client.put("/admin/tenants/acme/limits", json={"requests_per_minute": 5}).json()["requests_per_minute"] == 5
    for field in ("requests_per_minute", "tokens_per_minute"):  # over the database's 32-bit column: not a 500
        r = client.put("/admin/tenants/acme/limits", json={field: 2**31})
        assert r.status_code == 400 and r.json()["error"]["param"] == field and "2147483647" in r.text
        r = client.post("/admin/tenants", json={"name": "big", field: 10**20})
        assert r.status_code == 400 and r.json()["error"]["param"] == field
    assert client.post("/admin/tenants/acme/suspend").json()["status"] == "suspended"
    assert client.post("/admin/tenants/admin/suspend").status_code == 400
    assert client.delete(f"/admin/keys/{key['id']}").json()["revoked_at"]


def _expected_scope(method: str, path: str) -> str | None:
    """The scope an operation needs; None: any valid key. (Public probes are handled by the caller.)"""
    if path.startswith("/admin/"):
        return "admin"
    if path.startswith(("/v1/models", "/v1/completions", "/v1/chat/completions")):
        return "inference"
    if path.startswith("/v1/adapters") and method != "GET":
        return "adapters:write"
    return None


def test_every_operation_in_the_schema_checks_key_and_scope(client):
    """Walks /schema/openapi.json, so a route added later without a guard fails here (SECURITY.md 4)."""
    public = {"/health", "/ready", "/metrics"}
    r = client.post("/admin/tenants", json={"name": "acme"})
    assert r.status_code == 201
    keys = {}
    for scope in ("inference", "adapters:write"):
        r = client.post("/admin/keys", json={"tenant": "acme", "scopes": [scope]})
        keys[scope] = r.json()["key"]
    spec = client.get("/schema/openapi.json").json()
    checked = 0
    for template, operations in spec["paths"].items():
        path = re.sub(r"\{[^}]+\}", "acme", template)
        for method in operations:
            method = method.upper()
            if template in public:
                r = client.request(method, path, headers={"Authorization": ""})
                assert r.status_code in (200, 503) and "error" not in r.text, template  # /ready: no engine
                continue
            for auth in ("", "Bearer ", "Bearer lpx-notakey"):
                r = client.request(method, path, headers={"Authorization": auth}, json={})
                assert r.status_code == 401, (method, template, auth, r.status_code)
            needed = _expected_scope(method, template)
            for scope, key in keys.items():
                r = client.request(method, path, headers={"Authorization": f"Bearer {key}"}, json={})
                if needed is not None and needed != scope:
                    assert r.status_code == 403, (method, template, scope, r.status_code)
                else:
                    assert r.status_code not in (401, 403), (method, template, scope, r.status_code, r.text)
            checked += 1
    assert checked >= 25  # the schema really lists the platform's routes


def test_head_answers_every_get_route_as_get_does_without_a_body(client):
    """RFC 9110 9.3.2: a server that supports GET supports HEAD (Kubernetes probes and load balancers may send
    ``HEAD /health``). Same status, auth and headers as the GET; no body."""
    assert client.post("/admin/tenants", json={"name": "acme"}).status_code == 201
    auths = ["", "Bearer lpx-notakey", client.headers["Authorization"]]
    for scope in ("inference", "adapters:write"):
        auths.append(f"Bearer {client.post('/admin/keys', json={'tenant': 'acme', 'scopes': [scope]}).json()['key']}")
    spec = client.get("/schema/openapi.json").json()
    checked = 0
    for template, operations in spec["paths"].items():
        if "get" not in operations:
            continue
        path = re.sub(r"\{[^}]+\}", "acme", template)
        for auth in auths:
            got = client.get(path, headers={"Authorization": auth})
            head = client.head(path, headers={"Authorization": auth})
            assert head.status_code == got.status_code, (template, auth[:12], head.status_code, got.status_code)
            assert head.content == b"", template
            assert head.headers.get("content-type") == got.headers.get("content-type"), template
            if template != "/metrics":  # the scrape itself changes the next scrape's length
                assert head.headers.get("content-length") == got.headers.get("content-length"), template
            assert head.headers["x-request-id"].startswith("req-")
        checked += 1
    assert checked >= 10
    for path in ("/health", "/ready"):  # probes send no key
        assert client.head(path, headers={"Authorization": ""}).status_code == client.get(path).status_code
    r = client.head("/v1/completions")  # a POST route still refuses HEAD, and says what it allows
    assert r.status_code == 405 and r.content == b"" and "HEAD" not in r.headers["allow"]
    assert "HEAD" in client.put("/health").headers["allow"]


def _media_type_params(content_type: str) -> tuple[str, list[str]]:
    media, *params = [p.strip() for p in content_type.split(";")]
    return media, [p.split("=", 1)[0].lower() for p in params]


@pytest.mark.parametrize("path, media", [
    ("/metrics", "text/plain"),
    ("/admin/usage/export?format=csv", "text/csv"),
    ("/admin/usage/export?format=jsonl", "application/x-ndjson"),
])
def test_content_types_parse_with_each_parameter_once(client, path, media):
    """Prometheus 3 fails a scrape whose Content-Type does not parse (Go's mime.ParseMediaType refuses a
    repeated parameter), and CSV readers pick the charset from it: 'charset' must appear at most once."""
    r = client.get(path)
    assert r.status_code == 200
    got, names = _media_type_params(r.headers["content-type"])
    assert got == media and len(names) == len(set(names)), r.headers["content-type"]
    if media.startswith("text/"):
        assert "charset" in names
    if path == "/metrics":
        assert "version" in names


def test_an_empty_scope_list_is_refused_and_an_omitted_one_is_the_default(client):
    assert client.post("/admin/tenants", json={"name": "acme"}).status_code == 201
    r = client.post("/admin/keys", json={"tenant": "acme", "scopes": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "scopes", r.text
    assert "at least one" in r.json()["error"]["message"]
    assert client.get("/admin/keys", params={"tenant": "acme"}).json()["data"] == []  # nothing created
    r = client.post("/admin/keys", json={"tenant": "acme"})
    assert r.status_code == 201 and r.json()["scopes"] == ["inference"]


def test_the_admin_key_cannot_revoke_itself_over_http(client):
    own_id = parse_key(client.headers["Authorization"].removeprefix("Bearer "))
    r = client.delete(f"/admin/keys/{own_id}")
    assert r.status_code == 409, r.text
    err = r.json()["error"]
    assert err["param"] == "key_id" and own_id in err["message"] and err["code"] == "own_key"
    assert "another admin key" in err["message"] and "loraplex admin key revoke" in err["message"]
    assert client.get("/admin/tenants").status_code == 200  # still works: nothing was revoked
    # another admin key may revoke it (the operator is not locked out: the new key remains)
    other = client.post("/admin/keys", json={"tenant": "admin", "scopes": ["admin"]}).json()
    r = client.delete(f"/admin/keys/{own_id}", headers={"Authorization": f"Bearer {other['key']}"})
    assert r.status_code == 200 and r.json()["revoked_at"]
    assert client.get("/admin/tenants").status_code == 401


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", b'{"model": "m", "prompt": "a", "temperature": 1e309}', "temperature"),
    ("/v1/chat/completions", b'{"model": "m", "messages": [{"role": "user", "content": "a"}], "top_p": -1e400}',
     "top_p"),
    ("/v1/completions", b'{"model": "m", "prompt": "a", "logit_bias": {"5": 1, "7": 2E+999}}', "logit_bias.7"),
    ("/v1/chat/completions", b'{"model": "m", "messages": [{"role": "user", "content": "a"}, '
                             b'{"role": "user", "content": [{"type": "text", "x": 1e999}]}]}',
     "messages[1].content[0].x"),
    ("/admin/tenants", b'{"name": "acme", "requests_per_minute": 1e999}', "requests_per_minute"),
])
def test_a_json_number_out_of_range_names_its_field(client, path, body, param):
    r = client.post(path, content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param and "out of range" in err["message"] and param in err["message"], err


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/admin/tenants"])
@pytest.mark.parametrize("leaf", [b"1", b"1e999"])
def test_a_body_nested_too_deeply_is_a_400_not_a_server_fault(client, path, leaf, caplog):
    body = b'{"model": "m", "prompt": "a", "meta": ' + b"[" * 100_000 + leaf + b"]" * 100_000 + b"}"
    r = client.post(path, content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "invalid_value" and err["param"] is None
    assert "too deeply" in err["message"] and "levels" in err["message"], err
    assert "unhandled error" not in caplog.text


@pytest.mark.parametrize("body, words", [
    (b"", "body is empty"), (b"[1]", "got an array"), (b"null", "got null"), (b'"x"', "got a string"),
])
@pytest.mark.parametrize("path", ["/v1/completions", "/admin/tenants"])
def test_a_body_that_is_no_json_object_names_no_field(client, path, body, words):
    """The body as a whole has no ``param`` (OpenAI's null), never Litestar's argument name ``data``."""
    r = client.post(path, content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] is None and words in err["message"] and "'data'" not in err["message"], err
    # a field of the body is still named
    r = client.post(path, json={"name": 5, "model": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] in ("name", "model"), r.text


def test_a_key_expires_at_the_instant_sent_whatever_its_utc_offset(client):
    """SQLite keeps no offset: ``expires_at`` stored as sent was read back as that wall-clock time in UTC, so a
    key meant to last an hour (sent at -05:00) was dead on arrival, and one sent at +14:00 lived 14 hours more."""
    assert client.post("/admin/tenants", json={"name": "acme"}).status_code == 201
    now = datetime.now(timezone.utc)
    for hours in (-5, 14):
        wanted = (now + timedelta(hours=1)).astimezone(timezone(timedelta(hours=hours))).replace(microsecond=0)
        r = client.post("/admin/keys", json={"tenant": "acme", "expires_at": wanted.isoformat()})
        assert r.status_code == 201, r.text
        created = r.json()
        listed = {k["id"]: k for k in client.get("/admin/keys", params={"tenant": "acme"}).json()["data"]}
        assert datetime.fromisoformat(listed[created["id"]]["expires_at"]) == wanted, (hours, listed[created["id"]])
        r = client.get("/v1/models", headers={"Authorization": f"Bearer {created['key']}"})
        assert r.status_code != 401, (hours, r.text)


@pytest.mark.parametrize("body, param, words", [
    ({"expires_in_s": 101 * 365 * 86400}, "expires_in_s", "36500 days"),  # was cut to 10 years without a word
    ({"expires_in_s": 0}, "expires_in_s", "between 1 and"),
    ({"expires_in_s": 60, "expires_at": "2099-01-01T00:00:00Z"}, "expires_in_s", "not both"),
    ({"expires_at": "9999-12-31T23:59:59-05:00"}, "expires_at", "36500 days"),  # beyond what UTC can hold
    ({"expires_at": "2001-01-01T00:00:00+14:00"}, "expires_at", "future"),
])
def test_a_key_expiry_out_of_range_is_a_400_naming_the_field_and_the_limit(client, body, param, words):
    assert client.post("/admin/tenants", json={"name": "acme"}).status_code == 201
    r = client.post("/admin/keys", json={"tenant": "acme", **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
    assert client.get("/admin/keys", params={"tenant": "acme"}).json()["data"] == []  # nothing created
