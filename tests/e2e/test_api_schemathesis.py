"""schemathesis over /schema/openapi.json of a live server: no 5xx, and every response matches the
schema (status codes, content types, headers, bodies), for every operation (other areas' too)."""

from __future__ import annotations

import os

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.e2e.server import BACKENDS, backend_server

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance]


@pytest.fixture(scope="module", params=BACKENDS)
def live_server(request, tmp_path_factory):
    env = {"LORAPLEX_NUM_KV_BLOCKS": "512", "LORAPLEX_LOG_LEVEL": "WARNING"}
    with backend_server(request, tmp_path_factory, request.param, env=env) as srv:
        yield srv


# more for a deeper local run: LORAPLEX_TEST_SCHEMATHESIS_EXAMPLES=200
MAX_EXAMPLES = int(os.environ.get("LORAPLEX_TEST_SCHEMATHESIS_EXAMPLES", "15"))
INFERENCE_PATHS = ("/v1/completions", "/v1/chat/completions")


def test_no_server_errors_and_schema_conformance(live_server):
    """Every operation, fuzzed with an admin key (admin implies every scope); failures are collected so
    one run reports them all. (schemathesis' pytest plugin is not used: it breaks on pytest 9.)"""
    from hypothesis import given

    api = schemathesis.openapi.from_url(live_server.base_url + "/schema/openapi.json")
    headers = {"Authorization": f"Bearer {live_server.admin_key}"}
    base_model = httpx.get(live_server.base_url + "/v1/models", headers=headers).json()["data"][0]["id"]
    failures: dict[str, str] = {}
    operations = [result.ok() for result in api.get_all_operations()]
    assert len(operations) >= 10

    for operation in operations:
        @given(case=operation.as_strategy())
        @settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
                  database=None)
        def fuzz(case):
            if case.path in INFERENCE_PATHS and isinstance(case.body, dict):
                # a random model name only ever finds the 404: also drive the engine with the fuzzed
                # parameters (generation kept short so the CPU run stays quick)
                case.body["model"] = base_model
                for field in ("max_tokens", "max_completion_tokens"):
                    if isinstance(case.body.get(field), int) and case.body[field] > 8:
                        case.body[field] = 8
                if case.body.get("max_tokens") is None and case.body.get("max_completion_tokens") is None:
                    case.body["max_tokens"] = 8
            case.call_and_validate(headers=headers, checks=CHECKS, timeout=60)

        try:
            fuzz()
        except BaseException as exc:  # noqa: BLE001 - schemathesis raises a BaseExceptionGroup; collect all
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            failures[operation.label] = str(exc)[:3000]
    assert not failures, "\n\n".join(f"{k}:\n{v}" for k, v in failures.items())
    metrics = httpx.get(live_server.base_url + "/metrics").text
    completed = [ln for ln in metrics.splitlines()
                 if ln.startswith('loraplex_tenant_requests_total{status="completed",tenant="admin"}')]
    assert completed and float(completed[0].split()[-1]) > 0, "the fuzzing never reached the engine"


def test_schema_declares_error_objects(live_server):
    spec = httpx.get(live_server.base_url + "/schema/openapi.json").json()
    for path in ("/v1/chat/completions", "/v1/completions"):
        responses = spec["paths"][path]["post"]["responses"]
        assert {"200", "400", "401", "404", "429", "503"} <= set(responses), path
