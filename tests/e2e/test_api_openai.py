"""The OpenAI-compatible API against a live ``loraplex serve`` on a real port, with the official
``openai`` client: once on the embedded default (SQLite, in-process limiter, demo model generated on
first run) and once on PostgreSQL + Redis."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.server import BACKENDS, backend_server

LONG_PROMPT = " ".join(f"The {i}th lantern keeper walked north along the river at dawn." for i in range(24))
SERVER_ENV = {"LORAPLEX_NUM_KV_BLOCKS": "512", "LORAPLEX_MAX_CONCURRENT_REQUESTS": "8", "LORAPLEX_LOG_LEVEL": "INFO"}


@pytest.fixture(scope="module", params=BACKENDS)
def server(request, tmp_path_factory):
    with backend_server(request, tmp_path_factory, request.param, env=SERVER_ENV) as srv:
        yield srv


@pytest.fixture(scope="module")
def tenants(server):
    return {name: server.create_tenant(name) for name in ("acme", "globex")}


def oai(server, key: str, **kw) -> openai.OpenAI:
    return openai.OpenAI(api_key=key, base_url=server.base_url + "/v1", **kw)


def base_model(server) -> str:
    with server.client() as c:
        return c.get("/v1/models").json()["data"][0]["id"]


def test_models_completion_chat_and_streaming_usage(server, tenants):
    client = oai(server, tenants["acme"]["key"])
    models = [m.id for m in client.models.list()]
    model = models[0]
    # ids, never file paths
    assert all(not m.startswith("/") and str(server.data_dir) not in m and "adapters" not in m for m in models)

    r = client.completions.create(model=model, prompt="Once upon a time", max_tokens=6, temperature=0, seed=3,
                                  logprobs=2)
    assert r.object == "text_completion" and r.model == model and len(r.choices) == 1
    assert r.usage.completion_tokens == len(r.choices[0].logprobs.tokens) <= 6
    assert r.usage.prompt_tokens > 0 and r.usage.prompt_tokens_details.cached_tokens >= 0
    # up to N alternatives, plus the sampled token when it is not among them (as OpenAI does)
    assert all(1 <= len(top) <= 3 for top in r.choices[0].logprobs.top_logprobs)

    again = client.completions.create(model=model, prompt="Once upon a time", max_tokens=6, temperature=0, seed=3)
    assert again.choices[0].text == r.choices[0].text  # greedy is deterministic

    chat = client.chat.completions.create(model=model, messages=[{"role": "system", "content": "Be brief."},
                                                                 {"role": "user", "content": "Hello"}],
                                          max_tokens=5, n=2, temperature=0.8, seed=11, top_p=0.9)
    assert chat.object == "chat.completion" and [c.index for c in chat.choices] == [0, 1]
    assert all(c.message.role == "assistant" and c.finish_reason in ("stop", "length") for c in chat.choices)
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens

    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Tell a story"}],
                                            max_tokens=8, stream=True, stream_options={"include_usage": True},
                                            stop=["\n\n\n"])
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c for c in chunks if c.choices and c.choices[0].finish_reason]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens >= 1 and usage.prompt_tokens > 0
    assert isinstance(text, str)

    comp_stream = client.completions.create(model=model, prompt="abc", max_tokens=4, stream=True,
                                            stream_options={"include_usage": True})
    parts = list(comp_stream)
    assert parts[-1].usage.completion_tokens == 4 or parts[-1].usage.completion_tokens >= 1


def test_errors_the_client_parses(server, tenants, tiny_model):
    model = base_model(server)
    with pytest.raises(openai.AuthenticationError) as err:
        oai(server, "lpx-notakey").models.list()
    assert err.value.body["code"] == "invalid_api_key"
    wrong = tenants["acme"]["key"][:-2] + "zz"
    with pytest.raises(openai.AuthenticationError):
        oai(server, wrong).models.list()

    client = oai(server, tenants["acme"]["key"], max_retries=0)
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    assert err.value.body["param"] == "model" and err.value.body["code"] == "model_not_found"
    cases = [
        (dict(max_tokens=10**9), "max_tokens"),
        (dict(n=10000), "n"),
        (dict(stop=[f"s{i}" for i in range(500)]), "stop"),
        (dict(temperature=-1), "temperature"),
    ]
    for kw, param in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], **kw)
        assert err.value.body["param"] == param, kw
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model, prompt="word " * 5000, max_tokens=4)
    assert err.value.body["param"] == "prompt" and err.value.body["code"] == "context_length_exceeded"
    # token-id prompts: any id with an embedding row is accepted, anything else is refused, naming the limit
    vocab = tiny_model["vocab_size"]  # the served model
    ok = client.completions.create(model=model, prompt=[1, 5, vocab - 1], max_tokens=2)
    assert ok.usage.prompt_tokens == 3
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model, prompt=[1, vocab], max_tokens=2)
    assert err.value.body["param"] == "prompt" and f"[0, {vocab})" in err.value.body["message"]


def test_rate_limit_429_with_retry_headers(server):
    t = server.create_tenant("limited", requests_per_minute=2)
    client = oai(server, t["key"], max_retries=0)
    model = base_model(server)
    for _ in range(2):
        raw = client.completions.with_raw_response.create(model=model, prompt="hi", max_tokens=1)
        assert raw.headers["x-ratelimit-limit-requests"] == "2"
        assert "x-ratelimit-remaining-tokens" in raw.headers
    with pytest.raises(openai.RateLimitError) as err:
        client.completions.create(model=model, prompt="hi", max_tokens=1)
    headers = err.value.response.headers
    assert int(headers["retry-after"]) >= 1
    assert headers["x-ratelimit-remaining-requests"] == "0" and headers["x-ratelimit-reset-requests"].endswith("s")
    assert err.value.body["type"] == "rate_limit_error"


def test_a_request_over_the_token_limit_is_refused_once_not_retried(server):
    """The report's repro: 200 tokens/min, max_tokens=300. OpenAI's "Request too large" (the client raises
    RateLimitError), and x-should-retry: false keeps the client's default retries from sending it again."""
    t = server.create_tenant("small", tokens_per_minute=200)
    client = oai(server, t["key"])  # the default max_retries=2

    def rejected() -> float:
        text = httpx.get(server.base_url + "/metrics").text
        return sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith('loraplex_rejected_requests_total{reason="rate_limit"}'))

    before = rejected()
    with pytest.raises(openai.RateLimitError) as err:
        client.completions.create(model=base_model(server), prompt="Hi", max_tokens=300)
    assert err.value.code == "rate_limit_exceeded" and err.value.param == "max_tokens"
    message = err.value.body["message"]
    assert message.startswith(f"Request too large for {base_model(server)}: Limit 200 tokens per minute, "
                              "Requested 30"), message
    assert "Lower max_tokens to at most 19" in message
    assert rejected() == before + 1  # sent once
    # nothing was taken: a request that fits runs at once
    r = client.completions.with_raw_response.create(model=base_model(server), prompt="Hi", max_tokens=5)
    assert r.headers["x-ratelimit-remaining-tokens"] == str(200 - r.parse().usage.prompt_tokens - 5)


def test_request_id_on_every_response(server, tenants):
    key = tenants["acme"]["key"]
    with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {key}"}) as c:
        responses = [c.get("/v1/models"), c.get("/nope"), c.put("/health"), c.get("/admin/tenants"),
                     c.post("/v1/completions", json={"model": "x"}), c.get("/ready"),
                     c.get("/v1/models", headers={"Authorization": "Bearer bad"})]
        assert [r.status_code for r in responses] == [200, 404, 405, 403, 400, 200, 401]
        for r in responses:
            assert r.headers["x-request-id"]
            if r.status_code >= 400:
                assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        r = c.get("/v1/models", headers={"x-request-id": "trace-123"})
        assert r.headers["x-request-id"] == "trace-123"


def test_no_prompt_text_in_logs(server, tenants):
    marker = "zebra-marmalade-7731"
    client = oai(server, tenants["acme"]["key"])
    client.chat.completions.create(model=base_model(server), messages=[{"role": "user", "content": marker}],
                                   max_tokens=2)
    client.completions.create(model=base_model(server), prompt=marker, max_tokens=2)
    time.sleep(0.2)
    assert server.output and marker not in server.log_text()


def test_prefix_cache_is_per_tenant(server, tenants):
    model = base_model(server)
    a = oai(server, tenants["acme"]["key"])
    b = oai(server, tenants["globex"]["key"])

    def cached(client, **extra) -> int:
        r = client.completions.create(model=model, prompt=LONG_PROMPT, max_tokens=1, temperature=0,
                                      extra_body=extra)
        assert r.usage.prompt_tokens > 200
        return r.usage.prompt_tokens_details.cached_tokens

    # both send the same cache_salt (vLLM's field): a server that used it would let B hit A's prefix
    salt = "shared-salt-7"
    assert cached(a, cache_salt=salt) == 0
    # another tenant, with the same salt and even claiming A's tenant id, never hits A's cached prefix
    assert cached(b, cache_salt=salt, tenant_id=tenants["acme"]["tenant"]["id"]) == 0
    assert cached(a, cache_salt=salt) > 0  # the same tenant's repeat does hit
    assert cached(a, cache_salt="another") > 0  # and its own salt, whatever the body says


def test_tenant_keys_and_admin_routes_are_unreachable_for_tenants(server, tenants):
    acme, globex = tenants["acme"], tenants["globex"]
    with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {acme['key']}"}) as c:
        assert c.get("/admin/keys").status_code == 403
        assert c.delete(f"/admin/keys/{globex['key_id']}").status_code == 403
        assert c.post("/admin/tenants/globex/suspend").status_code == 403
        r = c.post("/admin/keys", json={"tenant": "acme", "scopes": ["admin"]})
        assert r.status_code == 403
    # globex still works
    assert oai(server, globex["key"]).models.list().data


def test_revocation_and_suspension_take_effect_within_a_second(server):
    t = server.create_tenant("shortlived")
    client = oai(server, t["key"], max_retries=0)
    client.models.list()  # cached now
    with server.client() as admin:
        assert admin.delete(f"/admin/keys/{t['key_id']}").status_code == 200
    t0 = time.monotonic()
    while True:
        try:
            client.models.list()
        except openai.AuthenticationError:
            break
        assert time.monotonic() - t0 < 1.0
        time.sleep(0.05)

    u = server.create_tenant("suspended-co")
    client = oai(server, u["key"], max_retries=0)
    client.models.list()
    proc = server.cli("admin", "tenant", "suspend", "suspended-co")  # another process, same database
    assert proc.returncode == 0, proc.stderr
    t0 = time.monotonic()
    while True:
        try:
            client.models.list()
        except openai.AuthenticationError:
            break
        assert time.monotonic() - t0 < 1.0, "suspension from the CLI not seen within 1 s"
        time.sleep(0.05)


def test_metrics_have_vllm_names_and_tenant_counters(server, tenants):
    oai(server, tenants["acme"]["key"]).completions.create(model=base_model(server), prompt="x", max_tokens=2)
    text = httpx.get(server.base_url + "/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds",
                 "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds", "vllm:lora_requests_info",
                 "vllm:cache_config_info", "vllm:num_preemptions_total", "loraplex:lora_slot_loads_total", "loraplex:lora_load_failures_total",
                 "loraplex:lora_host_load_seconds_total", "loraplex:lora_load_queue_depth",
                 "loraplex:lora_merges_total", "loraplex:lora_merged_steps_total", "loraplex:engine_loop_steps_total",
                 "loraplex:engine_loop_step_seconds_total", "loraplex:engine_loop_dispatch_seconds_total",
                 "loraplex:engine_loop_step_cpu_seconds_total", "loraplex:engine_device_wait_seconds_total",
                 "loraplex:engine_step_sequences_total", "loraplex:engine_prompt_steps_total",
                 "loraplex:engine_piecewise_graph_steps_total"):
        assert name in text, name
    loop = {line.split("{")[0]: float(line.split()[-1]) for line in text.splitlines()
            if line.startswith("loraplex:engine_loop_")}
    # the request above ran at least a prefill and a decode step in the loop thread, which timed them
    assert loop["loraplex:engine_loop_steps_total"] >= 2
    engine = {line.split("{")[0]: float(line.split()[-1]) for line in text.splitlines()
              if line.startswith(("loraplex:engine_step_sequences", "loraplex:engine_prompt_steps"))}
    assert engine["loraplex:engine_prompt_steps_total"] >= 1  # the prompt "x" (BOS + x: two tokens, one sequence)
    assert engine["loraplex:engine_step_sequences_total"] >= loop["loraplex:engine_loop_steps_total"]
    piecewise = [float(line.split()[-1]) for line in text.splitlines()
                 if line.startswith("loraplex:engine_piecewise_graph_steps_total")]
    assert piecewise == [0.0]  # the CPU runs no CUDA graph
    # loraplex serve froze its start-up heap once the engine had loaded (LORAPLEX_FREEZE_GC, on by default)
    assert "moved out of the collector's reach (gc.freeze)" in server.log_text()
    assert loop["loraplex:engine_loop_step_seconds_total"] > 0 and loop["loraplex:engine_loop_dispatch_seconds_total"] > 0
    assert 'loraplex_tenant_requests_total{status="completed",tenant="acme"}' in text
    assert 'loraplex_tenant_tokens_total{kind="completion",tenant="acme"}' in text
    # the request above returned after its usage was recorded: nothing is left in flight
    assert "loraplex:requests_in_flight 0.0" in text and "loraplex:max_concurrent_requests " in text


def test_client_disconnect_aborts_the_engine_request(server):
    t = server.create_tenant("leaver")
    model = base_model(server)

    def aborted() -> float:
        for line in httpx.get(server.base_url + "/metrics").text.splitlines():
            if line.startswith('loraplex_tenant_requests_total{status="aborted",tenant="leaver"}'):
                return float(line.split()[-1])
        return 0.0

    body = {"model": model, "prompt": "go", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {t['key']}"}) as c, \
            c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
    t0 = time.monotonic()
    while aborted() < 1:
        assert time.monotonic() - t0 < 1.0, "engine request not aborted within 1 s of the disconnect"
        time.sleep(0.05)


def test_admission_cap_gives_fast_503(server):
    """The server runs with LORAPLEX_MAX_CONCURRENT_REQUESTS=8: the 9th concurrent request is refused."""
    server.wait_none_in_flight(timeout_s=30)  # an earlier test's request would take a slot
    t = server.create_tenant("bursty")
    model = base_model(server)
    body = {"model": model, "prompt": "go", "max_tokens": 4000, "ignore_eos": True, "stream": True}
    clients = [httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {t['key']}"})
               for _ in range(8)]
    streams, readers = [], []
    try:
        for c in clients:
            s = c.stream("POST", "/v1/completions", json=body)
            r = s.__enter__()
            streams.append(s)
            assert r.status_code == 200
            # keep the reader: dropping it closes the response (a disconnect, which frees the slot)
            readers.append(r.iter_lines())
            next(readers[-1])
        t0 = time.monotonic()
        r = httpx.post(server.base_url + "/v1/completions", json={**body, "stream": False},
                       headers={"Authorization": f"Bearer {t['key']}"})
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
        assert time.monotonic() - t0 < 1.0 and r.json()["error"]["code"] == "overloaded"
    finally:
        for s in streams:
            s.__exit__(None, None, None)
        for c in clients:
            c.close()


def test_streams_closed_together_free_their_slots_at_once(server):
    """Eight streams dropped at the same moment, five times: each time every admission slot is back within a second
    and every aborted request's final report reached its usage record (it once waited out a 5 s timeout when the
    stream's reader took that report first)."""
    server.wait_none_in_flight(timeout_s=30)
    t = server.create_tenant("droppers")
    body = {"model": base_model(server), "prompt": "go", "max_tokens": 4000, "ignore_eos": True, "stream": True}
    for _ in range(5):
        clients = [httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {t['key']}"})
                   for _ in range(8)]
        streams = []
        for c in clients:
            s = c.stream("POST", "/v1/completions", json=body)
            r = s.__enter__()
            streams.append((s, r.iter_lines()))
            next(streams[-1][1])
        for s, _ in streams:
            s.__exit__(None, None, None)
        for c in clients:
            c.close()
        server.wait_none_in_flight(timeout_s=1.0)
    assert "abort report of" not in server.log_text()


def _adapter_dir(server) -> Path:
    """An adapter that fits the served base model (the demo's, or the tiny model's)."""
    model_dir = Path(server.env.get("LORAPLEX_MODEL") or server.data_dir / "demo-model")
    return sorted((model_dir / "adapters").iterdir())[0]


def _usage_totals(server, key: str) -> dict:
    with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {key}"}) as c:
        r = c.get("/v1/usage")
        assert r.status_code == 200, r.text
        return r.json()["totals"]


def test_another_tenants_adapter_and_usage_are_unreachable(server):
    owner = server.create_tenant("owner-co", scopes=["inference", "adapters:write"])
    other = server.create_tenant("other-co", scopes=["inference", "adapters:write"])
    src = _adapter_dir(server)
    with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {owner['key']}"}) as c:
        r = c.post("/v1/adapters", data={"name": "secret-tune"},
                   files={"config": ("adapter_config.json", (src / "adapter_config.json").read_bytes()),
                          "weights": ("adapter_model.safetensors", (src / "adapter_model.safetensors").read_bytes())})
        assert r.status_code == 201, r.text
    owner_client = oai(server, owner["key"], max_retries=0)
    deadline = time.monotonic() + 30
    while "secret-tune" not in [m.id for m in owner_client.models.list()]:
        assert time.monotonic() < deadline, "uploaded adapter never became usable"
        time.sleep(0.2)
    out = owner_client.completions.create(model="secret-tune", prompt="hello", max_tokens=3, temperature=0)
    assert out.model == "secret-tune" and out.usage.completion_tokens >= 1

    before = _usage_totals(server, other["key"])
    intruder = oai(server, other["key"], max_retries=0)
    assert "secret-tune" not in [m.id for m in intruder.models.list()]
    assert owner_client.models.retrieve("secret-tune").id == "secret-tune"
    public = [m.id for m in intruder.models.list() if "/" in m.id]  # e.g. the demo's admin/adapter-0
    if public:
        assert intruder.models.retrieve(public[0]).id == public[0]
    for name in ("secret-tune", "owner-co/secret-tune"):
        with pytest.raises(openai.NotFoundError):
            intruder.models.retrieve(name)
    bodies = []
    for name in ("secret-tune", "owner-co/secret-tune", "owner-co/secret-tune@1", "no-such-adapter"):
        with pytest.raises(openai.NotFoundError) as err:
            intruder.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}])
        bodies.append({k: v for k, v in err.value.body.items() if k != "message"})
        assert name in err.value.body["message"]
    assert all(b == bodies[-1] for b in bodies)  # foreign looks exactly like missing
    with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {other['key']}"}) as c:
        assert c.get("/v1/adapters/secret-tune").status_code == 404
        assert c.delete("/v1/adapters/secret-tune").status_code == 404
        assert "secret-tune" not in c.get("/v1/adapters").text
    owner_usage = _usage_totals(server, owner["key"])
    assert owner_usage["requests"] >= 1
    # the intruder's usage never shows the owner's requests
    assert _usage_totals(server, other["key"])["completion_tokens"] == before["completion_tokens"]


def test_concurrent_long_prompts_are_tokenized_safely(server, tenants):
    """Long prompts are tokenized off the event loop, one at a time: concurrent ones all get a clean
    answer (here a 400 for the context), never a 500 from a tokenizer used by two threads."""
    from concurrent.futures import ThreadPoolExecutor

    model = base_model(server)
    prompt = "river lantern " * 6000
    headers = {"Authorization": f"Bearer {tenants['acme']['key']}"}

    def call(i: int) -> int:
        body = {"model": model, "max_tokens": 2}
        if i % 2:
            body["messages"] = [{"role": "user", "content": prompt}]
            path = "/v1/chat/completions"
        else:
            body["prompt"] = prompt
            path = "/v1/completions"
        return httpx.post(server.base_url + path, json=body, headers=headers, timeout=60).status_code

    with ThreadPoolExecutor(6) as pool:
        codes = list(pool.map(call, range(6)))
    assert codes == [400] * 6
    r = oai(server, tenants["acme"]["key"]).completions.create(model=model, prompt="still fine", max_tokens=2)
    assert r.usage.completion_tokens >= 1
