"""OpenAI/vLLM compatibility details a client developer runs into, against one live embedded server,
with the official ``openai`` client: parameters the server cannot honour are refused naming them
(never silently ignored), ``echo`` + ``logprobs`` scores the prompt (what lm-eval-harness sends), a
chat template that refuses a conversation (or a model without one) is a 400, validation errors name the
field, the vLLM extensions the server accepts are honoured, and 404s/engine refusals answer documented
codes."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.server import start_server

# the demo template, plus the check real templates (Llama 2, Mistral, Gemma) make: they raise
STRICT_TEMPLATE_CHECK = (
    "{% for message in messages %}{% if message['role'] == 'system' and not loop.first %}"
    "{{ raise_exception('System message must come first') }}{% endif %}{% endfor %}"
)


# a variable a client may set through chat_template_kwargs (as Qwen3's enable_thinking)
GREETING = "{% if greeting is defined %}{{ greeting }}{% endif %}"

# and, as templates that show speaker names do, a message's `name` before its content
NAMED_CONTENT = "(message['name'] ~ ': ' if message['name'] is defined else '') ~ message['content']"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_model) -> Path:
    model = tmp_path_factory.mktemp("strict-model") / "demo-model"
    shutil.copytree(tiny_model["model_dir"], model)
    template = model / "chat_template.jinja"
    template.write_text(STRICT_TEMPLATE_CHECK + GREETING +
                        template.read_text().replace("message['content']", NAMED_CONTENT))
    return model


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_dir):
    # 128 blocks of 16 hold 2048 tokens, less than the model's 4096: the engine refuses longer sequences;
    # and it runs at most 16 sequences, while the API lets n reach 24: the engine refuses n over 16
    srv = start_server(tmp_path_factory.mktemp("compat"), demo_model_from=model_dir,
                       env={"LORAPLEX_NUM_KV_BLOCKS": "128", "LORAPLEX_MAX_NUM_SEQS": "16", "LORAPLEX_MAX_N": "24"})
    try:
        yield srv
    finally:
        assert srv.stop() == 0, srv.log_text()[-3000:]


@pytest.fixture(scope="module")
def client(server):
    key = server.create_tenant("compat")["key"]
    return openai.OpenAI(api_key=key, base_url=server.base_url + "/v1", max_retries=0)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def _refused(call, **kw) -> dict:
    with pytest.raises(openai.BadRequestError) as err:
        call(**kw)
    return err.value.body


USER = [{"role": "user", "content": "Hello"}]
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}


def test_parameters_the_server_cannot_honour_are_refused_naming_them(client, model):
    chat = client.chat.completions.create
    cases = [
        (dict(response_format={"type": "json_object"}), "response_format"),
        (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}), "response_format"),
        (dict(tools=[TOOL]), "tools"),  # tool_choice defaults to "auto" when tools are given
        (dict(tools=[TOOL], tool_choice="auto"), "tool_choice"),
        (dict(tools=[TOOL], tool_choice="required"), "tool_choice"),
        (dict(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "lookup"}}), "tool_choice"),
        (dict(functions=[TOOL["function"]]), "functions"),
        (dict(stream_options={"include_usage": True}), "stream_options"),  # only with stream=true
    ]
    for kw, param in cases:
        body = _refused(chat, model=model, messages=USER, max_tokens=2, **kw)
        assert body["param"] == param and body["type"] == "invalid_request_error", (kw, body)
        assert body["code"] in ("unsupported", "invalid_value"), body
    # vLLM's structured-output and beam-search extensions would otherwise come back as plain sampled text
    for extra in ({"guided_json": {"type": "object"}}, {"guided_regex": "[0-9]+"}, {"guided_choice": ["a", "b"]},
                  {"guided_grammar": "root ::= 'a'"}, {"structured_outputs": {"json": {}}}, {"use_beam_search": True}):
        for call, kw in ((chat, dict(messages=USER)), (client.completions.create, dict(prompt="x"))):
            body = _refused(call, model=model, max_tokens=2, extra_body=extra, **kw)
            assert body["param"] == next(iter(extra)) and body["code"] == "unsupported", (extra, body)
    # vLLM extensions the detokenizer cannot honour, a client's own template, echo on chat
    for extra in ({"spaces_between_special_tokens": False}, {"return_tokens_as_token_ids": True}):
        for call, kw in ((chat, dict(messages=USER)), (client.completions.create, dict(prompt="x"))):
            body = _refused(call, model=model, max_tokens=2, extra_body=extra, **kw)
            assert body["param"] == next(iter(extra)) and body["code"] == "unsupported", (extra, body)
    for extra in ({"chat_template": "{{ 'x' }}"}, {"echo": True}):
        body = _refused(chat, model=model, messages=USER, max_tokens=2, extra_body=extra)
        assert body["param"] == next(iter(extra)) and body["code"] == "unsupported", (extra, body)

    # the no-op forms are accepted, as OpenAI and vLLM accept them
    r = chat(model=model, messages=USER, max_tokens=2, logit_bias={}, response_format={"type": "text"},
             tools=[TOOL], tool_choice="none", user="end-user-7",
             extra_body={"use_beam_search": False, "bad_words": [], "spaces_between_special_tokens": True,
                         "return_tokens_as_token_ids": False, "echo": False})
    assert r.choices[0].message.tool_calls is None and r.usage.completion_tokens >= 1


def test_openai_parameters_for_output_this_server_lacks_are_refused_and_their_no_op_values_accepted(client, model):
    """Audio, predicted outputs, web search, reasoning effort, verbosity, moderation, another service tier and stored
    completions were silently ignored: a client got plain text back as if they had worked. Each is a 400 naming the
    field; its do-nothing value (and the fields that change no output: user, metadata, cache keys) is accepted."""
    chat = client.chat.completions.create
    audio = {"voice": "alloy", "format": "wav"}
    cases = [
        (dict(modalities=["text", "audio"], audio=audio), "modalities"),
        (dict(modalities=["audio"]), "modalities"),
        (dict(audio=audio), "audio"),
        (dict(prediction={"type": "content", "content": "Hello there"}), "prediction"),
        (dict(web_search_options={}), "web_search_options"),
        (dict(reasoning_effort="low"), "reasoning_effort"),
        (dict(verbosity="low"), "verbosity"),
        (dict(moderation={"model": "omni-moderation-latest"}), "moderation"),
        (dict(service_tier="flex"), "service_tier"),
        (dict(service_tier="priority"), "service_tier"),
        (dict(store=True), "store"),
    ]
    for kw, param in cases:
        for stream in (False, True):
            body = _refused(chat, model=model, messages=USER, max_tokens=2, stream=stream, **kw)
            assert body["param"] == param and body["code"] == "unsupported", (kw, body)
            assert body["message"].startswith(f"{param} ") and "not supported" in body["message"], body
    # vLLM takes response_format on completions too: refused there as on chat
    body = _refused(client.completions.create, model=model, prompt="x", max_tokens=2,
                    extra_body={"response_format": {"type": "json_object"}})
    assert body["param"] == "response_format" and body["code"] == "unsupported", body

    r = chat(model=model, messages=USER, max_tokens=2, modalities=["text"], audio=None, prediction=None,
             reasoning_effort=None, verbosity=None, service_tier="auto", store=False, metadata={"run": "7"},
             user="end-user-7", safety_identifier="hashed-7", prompt_cache_key="greeting",
             prompt_cache_retention="24h", prompt_cache_options={"mode": "implicit", "ttl": "30m"},
             parallel_tool_calls=False)
    assert r.usage.completion_tokens >= 1 and r.choices[0].message.content is not None
    assert chat(model=model, messages=USER, max_tokens=2, service_tier="default").usage.completion_tokens >= 1
    chunks = list(chat(model=model, messages=USER, max_tokens=2, stream=True,
                       stream_options={"include_usage": True, "include_obfuscation": False}))
    assert chunks[-1].usage.completion_tokens >= 1
    r = client.completions.create(model=model, prompt="x", max_tokens=2, extra_body={"response_format": {"type": "text"}})
    assert r.usage.completion_tokens >= 1


def test_echo_with_logprobs_scores_the_prompt_like_lm_eval(client, model, tiny_model):
    # greedy next token after P, then score P + [that token] with echo: the last prompt position must
    # carry the same logprob (what lm-eval-harness's loglikelihood requests rely on)
    prompt = [1, 17, 42, 99, 7, 250]
    first = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0, logprobs=1)
    lp = first.choices[0].logprobs
    token_text, token_lp = lp.tokens[0], lp.token_logprobs[0]

    scored = client.completions.create(model=model, prompt=[prompt, prompt[:3]], max_tokens=1, temperature=0,
                                       logprobs=1, echo=True)
    assert len(scored.choices) == 2
    for choice, ids in zip(scored.choices, (prompt, prompt[:3])):
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(ids) + 1
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
        assert all(v <= 0 for v in lp.token_logprobs[1:])
        assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    full = scored.choices[0]
    assert full.logprobs.token_logprobs[len(prompt)] == pytest.approx(token_lp, abs=1e-4)
    assert full.logprobs.tokens[len(prompt)] == token_text  # the greedy continuation is the same token

    # an echoed token-id prompt is the decoded prompt text (special tokens skipped), as for a string prompt
    from transformers import AutoTokenizer

    text_prompt = "Once upon a time"
    ids = AutoTokenizer.from_pretrained(tiny_model["model_dir"]).encode(text_prompt)
    by_ids = client.completions.create(model=model, prompt=ids, max_tokens=1, temperature=0, echo=True)
    assert by_ids.choices[0].text.startswith(text_prompt)

    # streamed: the same tokens and logprobs, prompt first
    chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0, logprobs=1,
                                            echo=True, stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(full.logprobs.token_logprobs[1:], abs=1e-4)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.text


def test_echo_with_max_tokens_0_returns_the_prompt_alone_scored_and_bills_no_completion(server, client, model):
    """Prompt scoring as OpenAI's legacy completions and vLLM answer it: ``echo`` + ``max_tokens=0`` is the prompt
    echoed (with ``logprobs``, its tokens' logprobs, the first one's null) and nothing generated, finish_reason
    "length", completion_tokens 0 in the response and in the usage ledger; streamed too. Without echo, 0 stays
    a 400."""
    tenant = server.create_tenant("scoring-co")
    scorer = openai.OpenAI(api_key=tenant["key"], base_url=server.base_url + "/v1", max_retries=0)
    prompt = "Hello there"
    one = scorer.completions.create(model=model, prompt=prompt, max_tokens=1, echo=True, logprobs=0, temperature=0)
    scored = scorer.completions.create(model=model, prompt=prompt, max_tokens=0, echo=True, logprobs=0)
    num_prompt = one.usage.prompt_tokens
    choice, lp = scored.choices[0], scored.choices[0].logprobs
    assert choice.text == prompt and choice.finish_reason == "length", choice
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == num_prompt
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    # the same prompt logprobs as the echo of a one-token completion, less its generated token
    assert lp.tokens == one.choices[0].logprobs.tokens[:num_prompt]
    assert lp.token_logprobs[1:] == pytest.approx(one.choices[0].logprobs.token_logprobs[1:num_prompt], abs=1e-4)
    assert (scored.usage.prompt_tokens, scored.usage.completion_tokens, scored.usage.total_tokens) == \
        (num_prompt, 0, num_prompt)
    # without logprobs: the text alone; n choices each echo it
    plain = scorer.completions.create(model=model, prompt=[prompt, "x"], max_tokens=0, echo=True, n=2)
    assert [c.text for c in plain.choices] == [prompt, prompt, "x", "x"] and plain.usage.completion_tokens == 0
    assert all(c.logprobs is None and c.finish_reason == "length" for c in plain.choices), plain

    chunks = list(scorer.completions.create(model=model, prompt=prompt, max_tokens=0, echo=True, logprobs=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == prompt
    streamed_lp = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert streamed_lp == lp.tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 0 and chunks[-1].usage.prompt_tokens == num_prompt

    for kw in (dict(), dict(logprobs=0), dict(echo=False)):
        body = _refused(scorer.completions.create, model=model, prompt=prompt, max_tokens=0, **kw)
        assert body["param"] == "max_tokens" and "got 0" in body["message"], body
    body = _refused(scorer.completions.create, model=model, prompt=prompt, max_tokens=0, echo=True,
                    extra_body={"min_tokens": 1})
    assert body["param"] == "min_tokens", body

    # the ledger bills what the responses said: the prompts, and the one generated token of the first request only
    server.wait_none_in_flight()
    with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {tenant['key']}"}) as c:
        totals = c.get("/v1/usage").json()["totals"]
    billed = [one.usage, scored.usage, plain.usage, chunks[-1].usage]
    assert totals["requests"] == len(billed), totals
    assert totals["completion_tokens"] == sum(u.completion_tokens for u in billed) == 1, totals
    assert totals["prompt_tokens"] == sum(u.prompt_tokens for u in billed), totals


def test_a_chat_template_that_refuses_the_conversation_is_a_400(client, model):
    body = _refused(client.chat.completions.create, model=model, max_tokens=2,
                    messages=[{"role": "user", "content": "hi"}, {"role": "system", "content": "late"}])
    assert body["param"] == "messages" and "System message must come first" in body["message"]
    ok = client.chat.completions.create(model=model, max_tokens=2, messages=[{"role": "system", "content": "x"},
                                                                             *USER])
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_validation_errors_name_the_field_and_carry_a_code(server, client, model):
    key = client.api_key
    with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {key}"}) as c:
        cases = [
            ({"messages": USER}, "model"),
            ({"model": model, "messages": [{"content": "x"}]}, "messages[0].role"),
            ({"model": model, "messages": [{"role": "user", "content": [{"text": "x"}]}]}, "messages[0].content[0].type"),
            ({"model": model, "messages": USER, "top_logprobs": 2}, "top_logprobs"),
            ({"model": model, "messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
            ({"model": model, "messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content"),
        ]
        for body, param in cases:
            r = c.post("/v1/chat/completions", json=body)
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == param and err["code"] == "invalid_value", (body, err)
        # a value of the wrong type has OpenAI's code for it
        r = c.post("/v1/chat/completions", json={"model": model, "messages": USER, "max_tokens": "many"})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "max_tokens" and err["code"] == "invalid_type", err
        r = c.post("/v1/chat/completions", json={"model": model, "messages": [{"role": "user",
                                                                                "content": [{"type": "text"}]}]})
        assert "text" in r.json()["error"]["message"] and "got 'text'" not in r.json()["error"]["message"]


def test_a_message_without_content_and_an_empty_model_are_400s_as_in_openai(client, model):
    """Content may be null (or left out) only on an assistant message that calls a tool or function; a user turn
    without content was rendered as an empty turn and answered. ``model: ""`` is a missing model (OpenAI's 400),
    not a 404 for a model named ""."""
    chat = client.chat.completions.create
    call = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
    cases = [
        ([{"role": "user", "content": None}], "messages[0].content", "invalid_type", "but got null instead"),
        ([{"role": "system"}, *USER], "messages[0].content", "invalid_value", "Missing required parameter"),
        ([*USER, {"role": "assistant", "content": None}, *USER], "messages[1].content", "invalid_type", "null"),
        ([*USER, {"role": "tool", "tool_call_id": "call_1", "content": None}], "messages[1].content",
         "invalid_type", "null"),
    ]
    for messages, param, code, words in cases:
        body = _refused(chat, model=model, messages=messages, max_tokens=2)
        assert body["param"] == param and body["code"] == code and words in body["message"], (messages, body)
        assert "tool_calls" in body["message"], body  # it says which message may have none
    # an assistant's tool call (or legacy function call) needs no content
    for assistant in ({"role": "assistant", "content": None, "tool_calls": [call]},
                      {"role": "assistant", "function_call": {"name": "lookup", "arguments": "{}"}}):
        r = chat(model=model, max_tokens=2, messages=[*USER, assistant,
                                                      {"role": "tool", "tool_call_id": "call_1", "content": "42"}])
        assert r.choices[0].finish_reason in ("stop", "length"), r

    for call, kw in ((chat, dict(messages=USER)), (client.completions.create, dict(prompt="x"))):
        body = _refused(call, model="", max_tokens=2, **kw)
        assert body["param"] == "model" and body["code"] == "invalid_value", body
        assert body["message"] == "You must provide a model parameter.", body


def test_values_are_typed_as_openai_types_them(server, client, model):
    """A string (or a boolean, or 5.0) where a number or a boolean is declared is a 400 naming the field and
    its type, never quietly converted (``"max_tokens": "5"`` once generated 5 tokens); an integer is a number."""
    with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {client.api_key}"}) as c:
        for path, body in (("/v1/completions", {"model": model, "prompt": "Hello"}),
                           ("/v1/chat/completions", {"model": model, "messages": USER})):
            for extra, param, words in (({"max_tokens": "5"}, "max_tokens", "expected an integer, but got a string"),
                                        ({"max_tokens": 5.0}, "max_tokens", "but got a decimal number"),
                                        ({"max_tokens": True}, "max_tokens", "but got a boolean"),
                                        ({"n": "2"}, "n", "expected an integer"),
                                        ({"temperature": "0.5"}, "temperature", "expected a number"),
                                        ({"stream": "false"}, "stream", "expected a boolean")):
                r = c.post(path, json={**body, **extra})
                err = r.json()["error"]
                assert r.status_code == 400 and err["param"] == param and err["code"] == "invalid_type", (path, err)
                assert err["message"].startswith(f"Invalid type for '{param}': ") and words in err["message"], err
            r = c.post(path, json={**body, "max_tokens": 2, "temperature": 1, "top_p": 1, "presence_penalty": 0,
                                   "stream": False, "n": 1})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] <= 2, r.json()


def test_vllm_stop_extensions_stop_token_ids_and_include_stop_str(client, model, tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model["model_dir"])
    prompt = [1, 33, 71, 5, 140]
    greedy = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, logprobs=0,
                                       extra_body={"ignore_eos": True})
    tokens = greedy.choices[0].logprobs.tokens
    # a generated token whose text names exactly one vocabulary id (partial characters, "bytes:\\xe2", do not)
    k, stop_id = next((k, ids[0]) for k, t in enumerate(tokens) if k > 0
                      for ids in [[i for i in range(len(tok)) if tok.decode([i]) == t]] if len(ids) == 1)
    k = tokens.index(tokens[k])  # its first occurrence
    r = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True, "stop_token_ids": [stop_id]})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == k + 1

    text = greedy.choices[0].text
    stop = next(text[i:i + 2] for i in range(1, len(text) - 1) if "\ufffd" not in text[i:i + 2])
    cut = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, stop=stop,
                                    extra_body={"ignore_eos": True})
    kept = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, stop=stop,
                                     extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert kept.choices[0].text == cut.choices[0].text + stop and kept.choices[0].finish_reason == "stop"

    for extra, param in (({"stop_token_ids": [len(tok) + 10**6]}, "stop_token_ids"),
                         ({"stop_token_ids": list(range(65))}, "stop_token_ids")):
        body = _refused(client.completions.create, model=model, prompt=prompt, max_tokens=2, extra_body=extra)
        assert body["param"] == param, body


def test_models_have_a_real_created_time(client):
    models = client.models.list().data
    assert models and all(0 < m.created <= time.time() + 1 for m in models), [(m.id, m.created) for m in models]
    assert client.models.retrieve(models[0].id).created == models[0].created


def test_a_model_without_a_chat_template_refuses_chat_naming_messages(tmp_path_factory, tiny_model):
    # the demo and test models ship one; a base model often does not (transformers raises ValueError)
    assert (Path(tiny_model["model_dir"]) / "chat_template.jinja").is_file()
    model = tmp_path_factory.mktemp("plain-model") / "demo-model"
    shutil.copytree(tiny_model["model_dir"], model)
    (model / "chat_template.jinja").unlink()
    srv = start_server(tmp_path_factory.mktemp("plain"), demo_model_from=model, env={"LORAPLEX_NUM_KV_BLOCKS": "64"})
    try:
        plain = openai.OpenAI(api_key=srv.create_tenant("plain")["key"], base_url=srv.base_url + "/v1",
                              max_retries=0)
        name = plain.models.list().data[0].id
        body = _refused(plain.chat.completions.create, model=name, messages=USER, max_tokens=2)
        assert body["param"] == "messages" and body["code"] == "unsupported", body
        assert "chat template" in body["message"] and "/v1/completions" in body["message"]
        assert plain.completions.create(model=name, prompt="Hello", max_tokens=2).usage.completion_tokens >= 1
    finally:
        assert srv.stop() == 0, srv.log_text()[-3000:]


def test_unknown_model_404_is_short_and_identical_for_another_tenants_adapter(server, client, tiny_model):
    def answers(name: str) -> list[tuple[int, bytes]]:
        with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {client.api_key}"}) as c:
            rs = [c.post("/v1/chat/completions", json={"model": name, "messages": USER, "max_tokens": 2}),
                  c.post("/v1/completions", json={"model": name, "prompt": "x", "max_tokens": 2}),
                  c.get(f"/v1/models/{name}")]
        return [(r.status_code, r.content) for r in rs]

    for status, content in answers("m" * 5000):
        err = httpx.Response(status, content=content).json()["error"]
        assert status == 404 and err["param"] == "model" and err["code"] == "model_not_found", err
        assert len(err["message"]) < 300 and "(5000 characters)" in err["message"], err["message"][:400]

    # SECURITY.md 1: another tenant's private adapter answers byte for byte what a missing one does
    name = "owner-co/hidden-tune"
    missing = answers(name)
    assert [s for s, _ in missing] == [404, 404, 404] and name.encode() in missing[0][1]
    owner = server.create_tenant("owner-co", scopes=["inference", "adapters:write"])
    src = Path(tiny_model["model_dir"]) / "adapters" / tiny_model["adapters"][0]["name"]
    with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {owner['key']}"}) as c:
        r = c.post("/v1/adapters", data={"name": "hidden-tune"},
                   files={"config": ("adapter_config.json", (src / "adapter_config.json").read_bytes()),
                          "weights": ("adapter_model.safetensors", (src / "adapter_model.safetensors").read_bytes())})
        assert r.status_code == 201, r.text
        assert c.get("/v1/models/hidden-tune").status_code == 200
    assert answers(name) == missing


def test_an_engine_refusal_is_a_documented_400_naming_the_field_streamed_or_not(server, client, model):
    # 128 KV blocks of 16 cannot hold 3000 tokens, though the model's context could; n=20 is over the
    # engine's max_num_seqs (16), though within the API's max_n (24). A streamed request is refused before
    # its response starts (it was a 200 whose stream ended in an error event, with param null)
    x_tokens = 1500 * [5]
    cases = [
        ("/v1/completions", {"prompt": "x", "max_tokens": 3000}, "max_tokens", "is 2046"),  # "x": 2 tokens
        ("/v1/completions", {"prompt": [x_tokens, [5]], "max_tokens": 600}, "max_tokens", "is 548"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 2, "n": 20}, "n", "max_num_seqs (16)"),
        ("/v1/chat/completions", {"messages": USER, "max_completion_tokens": 3000}, "max_completion_tokens", "KV"),
        ("/v1/chat/completions", {"messages": USER, "max_tokens": 2, "n": 20}, "n", "max_num_seqs"),
    ]
    key = server.create_tenant("refused-co")["key"]
    with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {key}"}) as c:
        for path, body, param, limit in cases:
            for stream in (False, True):
                r = c.post(path, json={"model": model, **body, "stream": stream})
                assert r.status_code == 400 and r.headers["content-type"].startswith("application/json"), r.text
                err = r.json()["error"]
                assert err["type"] == "invalid_request_error" and err["code"] == "invalid_value", err
                assert err["param"] == param and limit in err["message"], (path, body, err)
        # refused as a whole (also the list of prompts whose first one fits): nothing ran, nothing is metered
        assert c.post("/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 1}).status_code == 200
        for _ in range(50):
            totals = c.get("/v1/usage").json()["totals"]
            if totals["requests"]:
                break
            time.sleep(0.1)
    assert (totals["requests"], totals["errors"]) == (1, 0), totals
    assert f"| {err['code']}" in _documented_error_rows(400)


def _documented_error_rows(status: int) -> str:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()
    return "\n".join(line for line in doc.splitlines() if line.startswith(f"| {status} |"))


def test_vllm_sampling_extensions_are_honoured(client, model, tokenizer):
    prompt = [1, 33, 71, 5, 140]

    def complete(**kw):
        extra = {"ignore_eos": True, **kw.pop("extra", {})}
        return client.completions.create(model=model, prompt=prompt, max_tokens=12, logprobs=0, extra_body=extra,
                                         **kw)

    greedy = complete(temperature=0).choices[0]
    # top_k=1 and min_p=1 keep only the most likely token: greedy at any temperature
    assert complete(temperature=1.5, seed=5, extra={"top_k": 1}).choices[0].text == greedy.text
    assert complete(temperature=1.5, seed=5, extra={"min_p": 1.0}).choices[0].text == greedy.text
    assert complete(temperature=0, extra={"repetition_penalty": 5.0}).choices[0].text != greedy.text
    # min_tokens: a stop token before it does not stop the choice
    k, stop_id = _unique_token(tokenizer, greedy.logprobs.tokens)
    stopped = complete(temperature=0, extra={"stop_token_ids": [stop_id]}).choices[0]
    assert stopped.finish_reason == "stop" and len(stopped.logprobs.tokens) == k + 1
    held = complete(temperature=0, extra={"stop_token_ids": [stop_id], "min_tokens": k + 3}).choices[0]
    assert len(held.logprobs.tokens) >= k + 3


def test_allowed_token_ids_logit_bias_and_bad_words_are_honoured(client, model, tokenizer):
    """Two allowed tokens, one favoured by logit_bias: greedy repeats it; banning the word "zz" makes every z
    followed by q, banning "z" leaves only q (both endpoints)."""
    q, z = (tokenizer.encode(c, add_special_tokens=False)[0] for c in "qz")
    assert tokenizer.encode("zz", add_special_tokens=False) == [z, z]
    endpoints = ((client.completions.create, dict(prompt="Once"), lambda r: r.choices[0].text),
                 (client.chat.completions.create, dict(messages=USER), lambda r: r.choices[0].message.content))
    for call, kw, text_of in endpoints:
        texts = [text_of(call(model=model, max_tokens=6, temperature=0, logit_bias={str(z): 50},
                              extra_body={"ignore_eos": True, "allowed_token_ids": [q, z], **extra}, **kw))
                 for extra in ({}, {"bad_words": ["zz"]}, {"bad_words": ["z"]})]
        assert texts == ["zzzzzz", "zqzqzq", "qqqqqq"]
        assert text_of(call(model=model, max_tokens=4, temperature=1.5, seed=3,
                            extra_body={"ignore_eos": True, "allowed_token_ids": [q]}, **kw)) == "qqqq"


def test_token_restrictions_refuse_bad_values_naming_the_field_and_the_limit(server, client, model):
    cases = [
        ({"allowed_token_ids": []}, "allowed_token_ids", "empty"),
        ({"allowed_token_ids": [5, 512]}, "allowed_token_ids", "[0, 512)"),  # the model's vocabulary (the engine's check)
        ({"allowed_token_ids": [-1]}, "allowed_token_ids", ">= 0"),
        ({"allowed_token_ids": list(range(512)) + [5]}, "allowed_token_ids", "512"),
        ({"allowed_token_ids": "5"}, "allowed_token_ids", "array"),  # a wire type error
        ({"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
        ({"logit_bias": {"five": 1}}, "logit_bias", "token id"),
        ({"logit_bias": {"9999": 1}}, "logit_bias", "[0, 512)"),
        ({"bad_words": [""]}, "bad_words", "empty"),
        ({"bad_words": ["w"] * 65}, "bad_words", "64"),
        ({"bad_words": ["w" * 300]}, "bad_words", "256"),
    ]
    for call, kw in ((client.chat.completions.create, dict(messages=USER)), (client.completions.create, dict(prompt="x"))):
        for extra, param, limit in cases:
            body = _refused(call, model=model, max_tokens=2, extra_body=extra, **kw)
            code = "invalid_type" if extra == {"allowed_token_ids": "5"} else "invalid_value"
            assert body["param"] == param and body["code"] == code, (extra, body)
            assert limit in body["message"], (extra, body)
    # streamed: refused before the response starts, with the same 400
    key = client.api_key
    with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {key}"}) as c:
        r = c.post("/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 2, "stream": True,
                                            "allowed_token_ids": [70000]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids", r.text


def _unique_token(tokenizer, tokens: list[str]) -> tuple[int, int]:
    """(first position, id) of a generated token whose text names exactly one vocabulary id."""
    for k, text in enumerate(tokens):
        ids = [i for i in range(len(tokenizer)) if tokenizer.decode([i]) == text]
        if len(ids) == 1 and tokens.index(text) == k:
            return k, ids[0]
    raise AssertionError(f"no token with a unique text in {tokens}")


def test_skip_special_tokens_and_stop_reason(client, model, tokenizer):
    specials = set(tokenizer.all_special_tokens)

    def sample(**extra):
        return client.completions.create(model=model, prompt="Once", max_tokens=48, temperature=1.5, n=16, seed=1,
                                         logprobs=0, extra_body={"ignore_eos": True, **extra}).choices

    skipped, kept = sample(), sample(skip_special_tokens=False)
    assert any(specials & set(c.logprobs.tokens) for c in skipped)  # the random model does emit some
    assert not any(sp in c.text for c in skipped for sp in specials)
    with_specials = [c for c in kept if specials & set(c.logprobs.tokens)]
    assert with_specials and all(sp in c.text for c in with_specials for sp in specials & set(c.logprobs.tokens))

    # stop_reason (vLLM): the stop string or token id that ended the choice, else null
    prompt = [1, 33, 71, 5, 140]
    base = dict(model=model, prompt=prompt, max_tokens=8, temperature=0, logprobs=0)
    greedy = client.completions.create(**base, extra_body={"ignore_eos": True}).choices[0]
    assert greedy.finish_reason == "length" and greedy.model_extra.get("stop_reason", "absent") is None
    _, token_id = _unique_token(tokenizer, greedy.logprobs.tokens)
    by_id = client.completions.create(**base, extra_body={"ignore_eos": True, "stop_token_ids": [token_id]})
    assert by_id.choices[0].model_extra["stop_reason"] == token_id
    by_str = client.chat.completions.create(model=model, messages=USER, max_tokens=8, temperature=0,
                                            extra_body={"ignore_eos": True})
    text = by_str.choices[0].message.content
    stop = next(text[i:i + 2] for i in range(1, len(text) - 1) if "\ufffd" not in text[i:i + 2])
    cut = client.chat.completions.create(model=model, messages=USER, max_tokens=8, temperature=0, stop=stop,
                                         extra_body={"ignore_eos": True})
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].model_extra["stop_reason"] == stop
    chunks = list(client.chat.completions.create(model=model, messages=USER, max_tokens=8, temperature=0, stop=stop,
                                                 stream=True, extra_body={"ignore_eos": True}))
    last = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason][-1]
    assert last.model_extra["stop_reason"] == stop


def _rendered(tokenizer, messages, **kw) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, tokenize=True, **kw)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _prompt_tokens(client, model, messages, **extra) -> int:
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=1, temperature=0, extra_body=extra)
    return r.usage.prompt_tokens


def test_assistant_prefill_with_continue_final_message(client, model, tokenizer):
    # continue_final_message renders the last message open-ended, and the model continues it
    prefill = [*USER, {"role": "assistant", "content": "Once upon"}]
    ids = _rendered(tokenizer, prefill, continue_final_message=True)
    r = client.chat.completions.create(model=model, messages=prefill, max_tokens=4, temperature=0,
                                       extra_body={"add_generation_prompt": False, "continue_final_message": True})
    plain = client.completions.create(model=model, prompt=ids, max_tokens=4, temperature=0)
    assert r.usage.prompt_tokens == len(ids) and r.choices[0].message.content == plain.choices[0].text
    closed = _rendered(tokenizer, prefill)
    assert _prompt_tokens(client, model, prefill, add_generation_prompt=False) == len(closed) == len(ids) + 1
    assert _prompt_tokens(client, model, prefill) == len(_rendered(tokenizer, prefill, add_generation_prompt=True))
    body = _refused(client.chat.completions.create, model=model, messages=prefill, max_tokens=2,
                    extra_body={"continue_final_message": True})  # add_generation_prompt defaults to true
    assert body["param"] == "continue_final_message" and "add_generation_prompt" in body["message"], body


def test_text_parts_are_joined_by_newlines_and_names_reach_the_template(client, model, tokenizer):
    # text parts are joined with a newline, as vLLM does
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}]
    joined = _rendered(tokenizer, [{"role": "user", "content": "Hello\nthere"}], add_generation_prompt=True)
    glued = _rendered(tokenizer, [{"role": "user", "content": "Hellothere"}], add_generation_prompt=True)
    assert len(joined) != len(glued)
    assert _prompt_tokens(client, model, parts) == len(joined)
    # a message's name is the template's to show (the fixture's template writes "name: " before the content)
    named = [{"role": "user", "name": "zed", "content": "Hello"}]
    expected = _rendered(tokenizer, named, add_generation_prompt=True)
    assert len(expected) > len(_rendered(tokenizer, USER, add_generation_prompt=True))
    assert _prompt_tokens(client, model, named) == len(expected)


def test_text_offset_is_the_running_sum_of_token_lengths(client, model):
    # a random model emits partial characters (named "bytes:\\xe2") whose text the detokenizer holds back: offsets
    # must not stall
    def check(lp, start: int) -> None:
        assert lp.text_offset[0] == start
        for k in range(1, len(lp.tokens)):
            assert lp.text_offset[k] == lp.text_offset[k - 1] + len(lp.tokens[k - 1]), (k, lp.tokens, lp.text_offset)

    kw = dict(model=model, prompt="Once", max_tokens=32, temperature=1.5, seed=3, logprobs=1,
              extra_body={"ignore_eos": True})
    r = client.completions.create(**kw)
    assert any(t.startswith("bytes:\\x") for t in r.choices[0].logprobs.tokens)
    check(r.choices[0].logprobs, 0)
    chunks = list(client.completions.create(**kw, stream=True))
    offsets = [o for c in chunks if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert offsets == r.choices[0].logprobs.text_offset

    echoed = client.completions.create(**{**kw, "echo": True}).choices[0].logprobs
    check(echoed, 0)
    assert echoed.tokens[-32:] == r.choices[0].logprobs.tokens


def test_response_role_is_the_last_messages_without_a_generation_prompt(client, model):
    # vLLM: no assistant header opened, so the text continues the last message, in its role
    chat = client.chat.completions.create
    prefill = [*USER, {"role": "assistant", "content": "Once upon"}]
    for messages, extra, role in ((USER, {}, "assistant"), (USER, {"add_generation_prompt": False}, "user"),
                                  (prefill, {"add_generation_prompt": False, "continue_final_message": True},
                                   "assistant")):
        r = chat(model=model, messages=messages, max_tokens=2, extra_body=extra)
        assert r.choices[0].message.role == role, (messages, extra)
        first = next(iter(chat(model=model, messages=messages, max_tokens=2, extra_body=extra, stream=True)))
        assert first.choices[0].delta.role == role


def test_prompt_logprobs_in_vllms_shape(client, model):
    prompt = [1, 17, 42, 99, 7, 250]
    r = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0,
                                  extra_body={"prompt_logprobs": 2})
    plp = r.choices[0].model_extra["prompt_logprobs"]
    # the same numbers as echo + logprobs scoring (an OpenAI field, checked above against generation)
    scored = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0, logprobs=2,
                                       echo=True).choices[0].logprobs
    assert len(plp) == len(prompt) and plp[0] is None
    for k in range(1, len(prompt)):
        entry = plp[k]
        assert str(prompt[k]) in entry and 2 <= len(entry) <= 3, entry  # the token itself + the top 2
        assert entry[str(prompt[k])]["logprob"] == pytest.approx(scored.token_logprobs[k], abs=1e-4)
        assert {v["rank"] for v in entry.values()} >= {1, 2} and all(v["decoded_token"] is not None
                                                                     for v in entry.values())
    assert r.choices[0].logprobs is None and client.completions.create(
        model=model, prompt=prompt, max_tokens=1).choices[0].model_extra["prompt_logprobs"] is None

    c = client.chat.completions.create(model=model, messages=USER, max_tokens=1, n=2,
                                       extra_body={"prompt_logprobs": 0})
    plp = c.model_extra["prompt_logprobs"]
    assert len(plp) == c.usage.prompt_tokens and plp[0] is None and all(len(e) in (1, 2) for e in plp[1:])
    for call, kw in ((client.completions.create, dict(prompt=prompt)), (client.chat.completions.create,
                                                                         dict(messages=USER))):
        body = _refused(call, model=model, max_tokens=1, stream=True, extra_body={"prompt_logprobs": 1}, **kw)
        assert body["param"] == "prompt_logprobs", body  # vLLM refuses it streamed too
        body = _refused(call, model=model, max_tokens=1, extra_body={"prompt_logprobs": 21}, **kw)
        assert body["param"] == "prompt_logprobs", body


def test_truncate_prompt_tokens_keeps_the_last_tokens(client, model):
    prompt = [1, 33, 71, 5, 140, 17, 42, 99, 7, 250]
    cut = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0, echo=True,
                                    extra_body={"truncate_prompt_tokens": 4, "ignore_eos": True})
    tail = client.completions.create(model=model, prompt=prompt[-4:], max_tokens=4, temperature=0, echo=True,
                                     extra_body={"ignore_eos": True})
    assert cut.usage.prompt_tokens == 4 and cut.choices[0].text == tail.choices[0].text
    assert client.completions.create(model=model, prompt=prompt, max_tokens=1,
                                     extra_body={"truncate_prompt_tokens": -1}).usage.prompt_tokens == len(prompt)
    r = client.chat.completions.create(model=model, messages=USER, max_tokens=1,
                                       extra_body={"truncate_prompt_tokens": 3})
    assert r.usage.prompt_tokens == 3
    for bad in (0, -2, 4097):
        body = _refused(client.completions.create, model=model, prompt=prompt, max_tokens=1,
                        extra_body={"truncate_prompt_tokens": bad})
        assert body["param"] == "truncate_prompt_tokens" and "4096" in body["message"], body


def test_chat_template_kwargs_reach_the_template_but_never_the_servers_switches(client, model, tokenizer):
    greeting = "Ahoy there, matey"
    expected = _rendered(tokenizer, USER, add_generation_prompt=True, greeting=greeting)
    assert len(expected) > len(_rendered(tokenizer, USER, add_generation_prompt=True))
    assert _prompt_tokens(client, model, USER, chat_template_kwargs={"greeting": greeting}) == len(expected)
    # a variable the template never reads changes nothing (dropped, as vLLM drops it)
    plain = _prompt_tokens(client, model, USER)
    assert _prompt_tokens(client, model, USER, chat_template_kwargs={"unused_switch": True}) == plain
    for key, value in (("tokenize", False), ("chat_template", "{{ 'x' }}"), ("messages", []),
                       ("add_generation_prompt", False), ("continue_final_message", True), ("bos_token", "x"),
                       ("tools", [TOOL])):
        body = _refused(client.chat.completions.create, model=model, messages=USER, max_tokens=1,
                        extra_body={"chat_template_kwargs": {key: value}})
        assert body["param"] == f"chat_template_kwargs.{key}" and body["code"] == "invalid_value", (key, body)
