"""``loraplex serve --log-format json --access-log``: the server's log is JSON lines an operator can ship, with the
client's request id on the access line of each request and on lines logged while it ran."""

from __future__ import annotations

import json

from tests.e2e.server import KEY_RE, start_server


def test_json_log_and_access_log_of_a_live_server(tmp_path_factory, tiny_model):
    srv = start_server(tmp_path_factory.mktemp("json-log"), demo_model_from=tiny_model["model_dir"],
                       args=["--log-format", "json", "--access-log"])
    try:
        with srv.client() as c:
            model = c.get("/v1/models").json()["data"][0]["id"]
            r = c.post("/v1/completions", headers={"X-Request-Id": "e2e-trace-1"},
                       json={"model": model, "prompt": "Hello there", "max_tokens": 4})
            assert r.status_code == 200 and r.headers["x-request-id"] == "e2e-trace-1"
            completion_id = r.json()["id"]
    finally:
        assert srv.stop() == 0
    records, other = [], []
    for line in srv.output:
        if KEY_RE.search(line) and line.startswith("Bootstrap admin key"):
            continue  # stdout, printed once: never a log line
        try:
            records.append(json.loads(line))
        except ValueError:
            other.append(line)
    assert records and all({"ts", "level", "logger", "message"} <= set(r) for r in records)
    (access,) = [r for r in records if r["logger"] == "loraplex.access" and r.get("request_id") == "e2e-trace-1"]
    assert (access["method"], access["path"], access["status"]) == ("POST", "/v1/completions", 200)
    assert access["tenant"] == "admin" and access["completion_id"] == completion_id
    assert "Hello there" not in "\n".join(srv.output)
    assert other == []  # the engine's child process logs in its parent's format too
    assert any(r.get("process") == "engine" and "engine ready" in r["message"] for r in records)
