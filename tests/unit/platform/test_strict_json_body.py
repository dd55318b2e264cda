"""JSON bodies are typed strictly, as OpenAI's API types them: a string where a number or boolean is declared
(``"max_tokens": "5"``, ``"stream": "false"``) is a 400 naming the field and the type it takes, never a value
the server quietly converts. An integer is a number (``temperature: 1``); a boolean is not an integer, and
neither is a decimal number, even ``5.0`` (OpenAI: "expected an integer, but got a decimal number instead").

The app runs without an engine: a body that passes validation reaches the engine check and is a 503, so
every 400 here comes from the body's types alone. A type error's code is ``invalid_type`` (OpenAI's); a missing
field stays ``invalid_value``."""

from __future__ import annotations

import pytest
from litestar.testing import TestClient

from loraplex.platform.app import create_app
from loraplex.settings import Settings


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    keys: list[str] = []
    app = create_app(Settings(data_dir=str(tmp_path_factory.mktemp("strict"))), start_engine=False,
                     on_bootstrap_key=keys.append)
    with TestClient(app) as c:
        c.headers["Authorization"] = f"Bearer {keys[0]}"
        yield c


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.get("/v1/models").json()["data"][0]["id"]


USER = [{"role": "user", "content": "Hello"}]


def _error(r, code: str = "invalid_type") -> dict:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == code, err
    return err


@pytest.mark.parametrize(("extra", "param", "expected", "got"), [
    ({"max_tokens": "5"}, "max_tokens", "an integer", "a string"),
    ({"max_tokens": 5.0}, "max_tokens", "an integer", "a decimal number"),
    ({"max_tokens": True}, "max_tokens", "an integer", "a boolean"),
    ({"n": "2"}, "n", "an integer", "a string"),
    ({"seed": "7"}, "seed", "an integer", "a string"),
    ({"temperature": "0.5"}, "temperature", "a number", "a string"),
    ({"top_p": True}, "top_p", "a number", "a boolean"),
    ({"stream": "false"}, "stream", "a boolean", "a string"),
    ({"stream": 0}, "stream", "a boolean", "an integer"),
    ({"echo": "true"}, "echo", "a boolean", "a string"),
    ({"stream": True, "stream_options": {"include_usage": "true"}}, "stream_options.include_usage", "a boolean",
     "a string"),
    ({"stop_token_ids": [2, "3"]}, "stop_token_ids[1]", "an integer", "a string"),
    ({"logit_bias": {"7": 1.5, "9": "2"}}, "logit_bias.9", "a number", "a string"),
    ({"stop": 5}, "stop", "a string or an array", "an integer"),
    ({"prompt": [[1, "2"]]}, "prompt[0][1]", "an integer", "a string"),
])
def test_completions_refuse_a_value_of_another_type_naming_the_field_and_its_type(client, model, extra, param,
                                                                                   expected, got):
    err = _error(client.post("/v1/completions", json={"model": model, "prompt": "Hello", **extra}))
    assert err["param"] == param, err
    assert err["message"] == f"Invalid type for '{param}': expected {expected}, but got {got} instead.", err


@pytest.mark.parametrize(("extra", "param", "expected", "got"), [
    ({"max_completion_tokens": "5"}, "max_completion_tokens", "an integer", "a string"),
    ({"logprobs": "true"}, "logprobs", "a boolean", "a string"),
    ({"top_logprobs": 2.0}, "top_logprobs", "an integer", "a decimal number"),
    ({"messages": [*USER, {"role": "user", "content": 5}]}, "messages[1].content", "a string or an array",
     "an integer"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 7}]}]}, "messages[0].content[0].text",
     "a string", "an integer"),
    ({"messages": [{"role": True, "content": "x"}]}, "messages[0].role", "a string", "a boolean"),
])
def test_chat_refuses_a_value_of_another_type_naming_its_path(client, model, extra, param, expected, got):
    err = _error(client.post("/v1/chat/completions", json={"model": model, "messages": USER, **extra}))
    assert err["param"] == param, err
    assert err["message"] == f"Invalid type for '{param}': expected {expected}, but got {got} instead.", err


def test_a_body_that_is_not_an_object_names_no_field(client):
    err = _error(client.post("/v1/completions", json=[1, 2]))
    assert err["param"] is None
    assert err["message"] == "Invalid type for the request body: expected an object, but got an array instead."


@pytest.mark.parametrize("extra", [
    {"temperature": 1, "top_p": 1, "presence_penalty": 0, "frequency_penalty": 0, "min_p": 0},  # int for a float
    {"max_tokens": 5, "n": 1, "stream": False, "seed": -3, "logit_bias": {"7": 2}, "stop": ["a", "b"]},
    {"max_tokens": None, "temperature": None, "stream": None},
    {"prompt": [1, 2, 3]},
])
def test_values_of_the_declared_types_pass_validation(client, model, extra):
    # they reach the engine, which this app has not started: 503, not a 400
    r = client.post("/v1/completions", json={"model": model, "prompt": "Hello", **extra})
    assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded", r.text


def test_chat_messages_with_text_parts_and_integer_floats_pass_validation(client, model):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hello"}]}]
    r = client.post("/v1/chat/completions", json={"model": model, "messages": messages, "temperature": 0,
                                                   "max_completion_tokens": 3, "logprobs": False})
    assert r.status_code == 503, r.text


def test_missing_fields_are_still_named_at_their_path(client, model):
    err = _error(client.post("/v1/chat/completions", json={"model": model, "messages": [*USER, {"content": "x"}]}),
                 "invalid_value")
    assert err["param"] == "messages[1].role" and "missing required field `role`" in err["message"], err
    err = _error(client.post("/v1/completions", json={"prompt": "x", "max_tokens": 5}), "invalid_value")
    assert err["param"] == "model", err


# ---- admin JSON routes: the same rule (prices are documented as decimal strings, and stay so) ------------

@pytest.mark.parametrize(("method", "path", "body", "param", "expected"), [
    ("POST", "/admin/tenants", {"name": "strict-a", "requests_per_minute": "5"}, "requests_per_minute",
     "an integer"),
    ("PUT", "/admin/tenants/strict-t/limits", {"tokens_per_minute": "100"}, "tokens_per_minute", "an integer"),
    ("POST", "/admin/keys", {"tenant": "strict-t", "expires_in_s": "60"}, "expires_in_s", "an integer"),
    ("POST", "/admin/plans", {"name": "strict-p", "monthly_token_quota": "1000"}, "monthly_token_quota",
     "an integer"),
    ("PATCH", "/admin/plans/strict-plan", {"monthly_token_quota": "1000"}, "monthly_token_quota", "an integer"),
    ("PUT", "/admin/tenant-plans/strict-t", {"monthly_token_quota": "50"}, "monthly_token_quota", "an integer"),
])
def test_admin_routes_refuse_a_string_for_a_number(client, method, path, body, param, expected):
    assert client.post("/admin/tenants", json={"name": "strict-t"}).status_code in (201, 409)
    assert client.post("/admin/plans", json={"name": "strict-plan"}).status_code in (201, 409)
    err = _error(client.request(method, path, json=body))
    assert err["param"] == param
    assert err["message"] == f"Invalid type for '{param}': expected {expected}, but got a string instead.", err


def test_admin_values_of_the_declared_types_are_applied(client):
    r = client.post("/admin/tenants", json={"name": "strict-ok", "requests_per_minute": 5})
    assert r.status_code == 201 and r.json()["requests_per_minute"] == 5, r.text
    # prices take decimal strings (exact), and numbers
    r = client.post("/admin/plans", json={"name": "strict-priced", "input_per_mtok": "0.25", "output_per_mtok": 1,
                                          "adapter_surcharges": {"*": "0.5"}, "monthly_token_quota": 1000})
    assert r.status_code == 201, r.text
    assert r.json()["input_per_mtok"] == "0.25" and r.json()["monthly_token_quota"] == 1000, r.json()
