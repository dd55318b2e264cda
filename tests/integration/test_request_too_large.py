"""A request whose up-front charge (prompt + max_tokens × n) is more than the tenant's whole tokens-per-minute
bucket can never run: it is refused at once, as OpenAI's "Request too large", and takes nothing (no request or
token from the buckets, no quota, no engine work, no usage). A chat request without max_tokens has its default
budget cut to the limit instead. The app runs in-process with the tiny model on the CPU, once embedded (SQLite,
in-process buckets) and once on PostgreSQL + Redis (the buckets' Lua script)."""

from __future__ import annotations

import pytest

from tests.integration.usage_app import usage_app

TPM = 200
RPM = 600


@pytest.fixture(params=["embedded", "redis"])
def backing(request):
    """Settings for where the buckets live: the embedded default, or PostgreSQL + Redis."""
    if request.param == "embedded":
        yield {}
        return
    from tests.e2e.server import FreshPostgres

    with FreshPostgres(request.getfixturevalue("postgres_url")) as url:
        yield {"database_url": url, "redis_url": request.getfixturevalue("redis_url")}


@pytest.fixture
async def app(backing, tmp_path, tiny_model):
    async with usage_app(tmp_path, model=tiny_model["model_dir"], max_model_len=512, num_kv_blocks=256,
                         **backing) as ua:
        yield ua


async def _small_tenant(ua, name: str) -> tuple[str, str]:
    """A tenant limited to TPM tokens per minute: its key and the base model's id."""
    r = await ua.client.post("/admin/tenants", json={"name": name, "tokens_per_minute": TPM}, headers=ua.headers())
    assert r.status_code == 201, r.text
    r = await ua.client.post("/admin/keys", json={"tenant": name}, headers=ua.headers())
    key = r.json()["key"]
    model = (await ua.client.get("/v1/models", headers=ua.headers(key))).json()["data"][0]["id"]
    return key, model


async def test_a_request_over_the_token_limit_is_refused_at_once_and_takes_nothing(app):
    key, model = await _small_tenant(app, "acme")
    prompt_tokens = len(app.services.engine.encode("Hi"))
    headers = app.headers(key)
    for path, body in (("/v1/completions", {"prompt": "Hi", "max_tokens": 300}),
                       ("/v1/completions", {"prompt": "Hi", "max_tokens": 300, "stream": True}),
                       ("/v1/completions", {"prompt": "Hi", "max_tokens": 60, "n": 4})):
        r = await app.client.post(path, json={"model": model, **body}, headers=headers)
        assert r.status_code == 429, r.text
        err = r.json()["error"]
        assert (err["type"], err["code"], err["param"]) == ("rate_limit_error", "rate_limit_exceeded", "max_tokens")
        requested = prompt_tokens + body["max_tokens"] * body.get("n", 1)
        assert err["message"].startswith(f"Request too large for {model}: Limit {TPM} tokens per minute, "
                                         f"Requested {requested} "), err
        fits = (TPM - prompt_tokens) // body.get("n", 1)
        assert f"Lower max_tokens to at most {fits}" in err["message"], err
        assert r.headers["x-should-retry"] == "false" and "retry-after" not in r.headers
    chat = await app.client.post("/v1/chat/completions", headers=headers, json={
        "model": model, "messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 300})
    assert chat.status_code == 429 and chat.json()["error"]["param"] == "max_completion_tokens", chat.text

    # nothing was taken: both buckets are full, so a request that fits is charged from a full bucket
    r = await app.client.post("/v1/completions", headers=headers,
                              json={"model": model, "prompt": "Hi", "max_tokens": 5, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.headers["x-ratelimit-remaining-requests"] == str(RPM - 1)
    assert r.headers["x-ratelimit-remaining-tokens"] == str(TPM - prompt_tokens - 5)
    usage = (await app.client.get("/v1/usage", headers=headers)).json()["totals"]
    assert usage["requests"] == 1 and usage["total_tokens"] == prompt_tokens + 5
    assert app.services.admission.in_flight == 0


async def test_a_chat_without_max_tokens_runs_on_what_the_limit_holds_and_leaves_no_debt(app):
    """Its default budget (the rest of the context) is cut to the tenant's limit: the answer ends at that length and
    the bucket ends at (about) zero, not in debt: a small request next waits a second or two, not minutes."""
    key, model = await _small_tenant(app, "globex")
    r = await app.client.post("/v1/chat/completions", headers=app.headers(key), json={
        "model": model, "messages": [{"role": "user", "content": "Hello"}], "n": 2, "temperature": 1.0, "seed": 1,
        "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    prompt_tokens = body["usage"]["prompt_tokens"]
    budget = (TPM - prompt_tokens) // 2
    assert [c["finish_reason"] for c in body["choices"]] == ["length", "length"]
    assert body["usage"]["completion_tokens"] == 2 * budget
    assert body["usage"]["total_tokens"] <= TPM
    r = await app.client.post("/v1/completions", headers=app.headers(key),
                              json={"model": model, "prompt": "Hi", "max_tokens": 1})
    assert r.status_code == 200 or (r.status_code == 429 and int(r.headers["retry-after"]) <= 2), r.headers
