"""``loraplex batch`` on OpenAI batch-format input (OpenAI's Batch API, vLLM's ``run_batch``): OpenAI batch-format
output with the text loraplex's own lines give, under each line's custom_id, and a clear error per bad line."""

from __future__ import annotations

import json
import os
from pathlib import Path

from loraplex import LLM, SamplingParams
from loraplex.cli import main
from tests.conftest import adapter_dir, nan_adapter
from tests.unit.batch.test_batch_cli import _run, _write_jsonl

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


def _line(custom_id, url, body, **envelope) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body, **envelope}


def _read(path) -> list[dict]:
    return [json.loads(x) for x in Path(path).read_text().splitlines()]


def _ok_body(record: dict) -> dict:
    assert record["error"] is None and record["response"]["status_code"] == 200, record
    assert record["id"].startswith("batch_req_") and record["response"]["request_id"], record
    return record["response"]["body"]


def test_completion_lines_give_the_text_of_loraplex_lines_each_under_its_custom_id(tiny_model, tmp_path):
    """The same prompts in both formats: each OpenAI line's completion is the loraplex line's greedy text and
    tokens, written under that line's custom_id, in input order, as the server's text_completion object."""
    model_dir = tiny_model["model_dir"]
    jobs = [("zeta", "The river runs", 6), ("alpha", "Hello there", 3), ("mid", [1, 40, 41, 42], 5)]
    names = [model_dir, Path(model_dir).name, model_dir]  # --model as given, or its directory's name
    src, dst = tmp_path / "openai.jsonl", tmp_path / "openai.out.jsonl"
    _write_jsonl(src, [_line(cid, COMPLETIONS, {"model": name, "prompt": prompt, "max_tokens": m, "ignore_eos": True,
                                                    "temperature": 0})
                       for (cid, prompt, m), name in zip(jobs, names)])
    own_src, own_dst = tmp_path / "own.jsonl", tmp_path / "own.out.jsonl"
    _write_jsonl(own_src, [{"id": cid, **({"prompt": p} if isinstance(p, str) else {"prompt_token_ids": p}),
                            "params": {"max_tokens": m, "ignore_eos": True}} for cid, p, m in jobs])
    assert _run(tiny_model, src, dst) == 0
    assert _run(tiny_model, own_src, own_dst) == 0
    out, own = _read(dst), _read(own_dst)
    assert [o["custom_id"] for o in out] == ["zeta", "alpha", "mid"]
    assert len({o["id"] for o in out}) == 3
    for record, mine, name, (_, _, max_tokens) in zip(out, own, names, jobs):
        body = _ok_body(record)
        assert body["object"] == "text_completion" and body["id"].startswith("cmpl-") and body["model"] == name
        [choice] = body["choices"]
        assert choice["text"] == mine["outputs"][0]["text"] and choice["finish_reason"] == "length"
        assert body["usage"] == {"prompt_tokens": mine["num_prompt_tokens"], "completion_tokens": max_tokens,
                                 "total_tokens": mine["num_prompt_tokens"] + max_tokens,
                                 "prompt_tokens_details": {"cached_tokens": mine["num_cached_tokens"]}}
    assert len({o["response"]["body"]["choices"][0]["text"] for o in out}) == 3  # each line its own completion


def test_chat_lines_give_llm_chat_text(tiny_model, tmp_path):
    """A chat line renders its messages with the model's chat template as LLM.chat does; n samples come back as n
    choices; max_completion_tokens bounds them; with add_generation_prompt false the message keeps the last role."""
    model = tiny_model["model_dir"]
    talk = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(src, [
        _line("greedy", CHAT, {"model": model, "messages": talk, "max_completion_tokens": 5, "ignore_eos": True,
                               "temperature": 0}),
        _line("two", CHAT, {"model": model, "messages": talk, "max_tokens": 3, "n": 2, "temperature": 1.0,
                            "seed": 7}),
        _line("no-turn", CHAT, {"model": model, "messages": talk, "add_generation_prompt": False, "max_tokens": 2}),
    ])
    assert _run(tiny_model, src, dst) == 0
    greedy, two, no_turn = _read(dst)
    want = LLM(model, dtype="float32").chat(talk, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
    body = _ok_body(greedy)
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"][0]["message"] == {"content": want.outputs[0].text, "role": "assistant", "refusal": None}
    assert body["usage"]["prompt_tokens"] == len(want.prompt_token_ids) and body["usage"]["completion_tokens"] == 5
    choices = _ok_body(two)["choices"]
    assert [c["index"] for c in choices] == [0, 1] and _ok_body(two)["usage"]["completion_tokens"] <= 6
    assert _ok_body(no_turn)["choices"][0]["message"]["role"] == "user"  # no assistant turn opened: the last role


def test_each_bad_line_fails_alone_as_openai_writes_it(tiny_model, tmp_path):
    """A line that is no request (not JSON, no custom_id, another method or url, no body, a loraplex line) has
    ``"response": null`` and an ``error`` naming its line and field; a request the server would refuse has the
    server's error response (status, ``{"error": {message, type, param, code}}``) and ``"error": null``, as OpenAI
    writes a request that got an HTTP response; fields the server honours that a batch line cannot carry are refused
    (``unsupported``); the good lines around them still run."""
    model = tiny_model["model_dir"]
    good = {"model": model, "prompt": [1, 40, 41], "max_tokens": 3, "ignore_eos": True, "temperature": 0}
    talk = [{"role": "user", "content": "x"}]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(src, [
        _line("ok-1", COMPLETIONS, good),
        _line("get", COMPLETIONS, good, method="GET"),
        _line("embed", "/v1/embeddings", {"model": model, "input": "x"}),
        {k: v for k, v in _line(None, COMPLETIONS, good).items() if k != "custom_id"},
        "{not json",
        {"custom_id": "typo", "method": "POST", "url": COMPLETIONS, "Body": good},
        _line("range", COMPLETIONS, {**good, "temperature": -1}),
        _line("model", COMPLETIONS, {**good, "model": "gpt-4o-mini"}),
        _line("echo", COMPLETIONS, {**good, "echo": True}),
        _line("role", CHAT, {"model": model, "messages": [{"role": "robot", "content": "x"}]}),
        _line("long", COMPLETIONS, {**good, "prompt": [5] * 70}),
        _line("max", CHAT, {"model": model, "messages": talk, "max_completion_tokens": 0}),
        {"id": "own", "prompt": "Hello"},
        _line("type", COMPLETIONS, {**good, "max_tokens": "3"}),
        _line("stream", CHAT, {"model": model, "messages": talk, "stream": True}),
        _line("two", COMPLETIONS, {**good, "prompt": ["a", "b"]}),
        _line("nobody", COMPLETIONS, None),
        _line("ok-2", COMPLETIONS, good),
    ])
    assert _run(tiny_model, src, dst, "--max-model-len", "64") == 1
    out = _read(dst)
    assert [o["custom_id"] for o in out] == ["ok-1", "get", "embed", None, None, "typo", "range", "model",
                                            "echo", "role", "long", "max", None, "type", "stream", "two",
                                            "nobody", "ok-2"]
    by_line = dict(enumerate(out, start=1))
    envelope = {2: ("invalid_method", "method"), 3: ("invalid_url", "/v1/chat/completions"),
                4: ("invalid_custom_id", "custom_id"), 5: ("invalid_json", "is not JSON"),
                6: ("invalid_line", "Body: not a field"), 13: ("invalid_line", "loraplex's own line format"),
                17: ("invalid_line", "body: missing")}
    for line_no, (code, needle) in envelope.items():
        record = by_line[line_no]
        assert record["response"] is None and record["error"]["code"] == code, record
        assert record["error"]["message"].startswith(f"line {line_no}") and needle in record["error"]["message"]
    assert "/v1/completions" in by_line[3]["error"]["message"]  # the allowed urls named
    refused = {7: (400, "invalid_value", "temperature", "temperature must be between 0.0 and 2.0, got -1.0."),
               8: (404, "model_not_found", "model",
                   "The model 'gpt-4o-mini' does not exist or you do not have access to it."),
               9: (400, "unsupported", "echo", "echo is not supported by loraplex batch: "),
               10: (400, "invalid_value", "messages[0].role", "messages[0].role must be one of "),
               11: (400, "context_length_exceeded", "prompt", "This model's maximum context length is 64 tokens; "
                                                             "the prompt has 70 tokens"),
               12: (400, "invalid_value", "max_completion_tokens", "max_completion_tokens must be between 1 and "),
               14: (400, "invalid_type", "max_tokens",
                    "Invalid type for 'max_tokens': expected an integer, but got a string instead."),
               15: (400, "unsupported", "stream", "stream is not supported by loraplex batch: "),
               16: (400, "unsupported", "prompt", "prompt holds 2 prompts: a loraplex batch line runs one")}
    for line_no, (status, code, param, message) in refused.items():
        record = by_line[line_no]
        assert record["error"] is None and record["response"]["status_code"] == status, record
        error = record["response"]["body"]["error"]
        assert (error["code"], error["param"], error["type"]) == (code, param, "invalid_request_error"), record
        assert error["message"].startswith(message), record
    want = LLM(model, dtype="float32").generate({"prompt_token_ids": [1, 40, 41]},
                                                SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    for record in (by_line[1], by_line[18]):
        assert _ok_body(record)["choices"][0]["text"] == want[0].outputs[0].text


def test_a_repeated_custom_id_is_refused_before_anything_runs(tiny_model, tmp_path, capsys):
    """As OpenAI refuses such a file: one error line naming the custom_id and its lines; OUTPUT is not created.
    Lines without a custom_id do not count as repeats of each other (each fails on its own)."""
    model = tiny_model["model_dir"]
    body = {"model": model, "prompt": "Hi"}
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(src, [_line("x", COMPLETIONS, body), _line("y", COMPLETIONS, body), {"body": body},
                       _line("x", CHAT, {"model": model, "messages": [{"role": "user", "content": "Hi"}]}),
                       {"body": body}])
    assert _run(tiny_model, src, dst) == 2
    err = capsys.readouterr().err
    assert 'repeats custom_ids' in err and 'custom_id "x" on lines 1 and 4' in err and '"y"' not in err, err
    assert "line 3" not in err and not dst.exists()


def test_lora_modules_name_the_adapters_body_model_may_name(tiny_model, tmp_path, capsys):
    """``--lora-modules NAME=PATH``: a line whose body.model is NAME runs that adapter, as the loraplex line with the
    same adapter in ``lora`` does; an adapter that fails to load fails its lines (503, as the server), the others
    run."""
    model, path = tiny_model["model_dir"], adapter_dir(tiny_model, 0)
    broken = nan_adapter(tiny_model, 1, tmp_path / "broken")
    prompt = [1, 40, 41, 42]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(src, [_line(name, COMPLETIONS, {"model": name, "prompt": prompt, "max_tokens": 8, "ignore_eos": True,
                                                     "temperature": 0})
                       for name in ("a0", model, "broken")])
    own_src, own_dst = tmp_path / "own.jsonl", tmp_path / "own.out.jsonl"
    _write_jsonl(own_src, [{"prompt_token_ids": prompt, "params": {"max_tokens": 8, "ignore_eos": True},
                            "lora": {"name": "a0", "id": 1, "path": path}}])
    flags = ("--enable-lora", "--lora-modules", f"a0={path}", f"broken={broken}")
    assert _run(tiny_model, src, dst, *flags) == 1
    assert _run(tiny_model, own_src, own_dst, "--enable-lora") == 0
    adapter, base, failed = _read(dst)
    adapter_text = _ok_body(adapter)["choices"][0]["text"]
    assert adapter_text == _read(own_dst)[0]["outputs"][0]["text"]
    assert adapter_text != _ok_body(base)["choices"][0]["text"]  # the adapter changes the output
    error = failed["response"]["body"]["error"]  # as the server answers a generation that failed
    assert failed["error"] is None and failed["response"]["status_code"] == 503, failed
    assert (error["code"], error["type"]) == ("engine_error", "server_error")
    assert error["message"].startswith("The inference engine failed: ") and "NaN" in error["message"]

    for bad, needle in ((["--lora-modules", f"a0={path}"], "--lora-modules needs --enable-lora"),
                        (["--enable-lora", "--lora-modules", "a0"], "NAME=PATH"),
                        (["--enable-lora", "--lora-modules", f"a0={tmp_path / 'none'}"], "is not a directory"),
                        (["--enable-lora", "--lora-modules", f"a0={path}", f"a0={path}"], "'a0' twice")):
        assert _run(tiny_model, src, tmp_path / "refused.jsonl", *bad) == 2
        assert needle in capsys.readouterr().err


def test_an_adapter_over_the_rank_limit_fails_its_lines_naming_the_flag(tiny_model, tmp_path):
    """The engine says max_lora_rank; the batch's user typed --max-lora-rank (as the engine's other refusals of a
    line are worded), in both formats."""
    big = adapter_dir(tiny_model, 5)  # rank 64
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(src, [_line("big", COMPLETIONS, {"model": "big", "prompt": [1, 40], "max_tokens": 2})])
    assert _run(tiny_model, src, dst, "--enable-lora", "--max-lora-rank", "32", "--lora-modules", f"big={big}") == 1
    (failed,) = _read(dst)
    message = failed["response"]["body"]["error"]["message"]
    assert "--max-lora-rank" in message and "max_lora_rank" not in message, message
    own_src, own_dst = tmp_path / "own.jsonl", tmp_path / "own.out.jsonl"
    _write_jsonl(own_src, [{"prompt_token_ids": [1, 40], "params": {"max_tokens": 2},
                            "lora": {"name": "big", "id": 1, "path": big}}])
    assert _run(tiny_model, own_src, own_dst, "--enable-lora", "--max-lora-rank", "32") == 1
    error = json.loads(own_dst.read_text())["outputs"][0]["error"]
    assert "--max-lora-rank" in error and "max_lora_rank" not in error, error


def test_resume_continues_an_openai_output_and_holds_to_its_lora_modules(tiny_model, tmp_path, capsys):
    """--resume matches OUTPUT's lines with the input's by custom_id and runs only the rest; --lora-modules is
    recorded with the run's options, so a resume with other adapters is refused naming the flag."""
    model, path = tiny_model["model_dir"], adapter_dir(tiny_model, 0)
    src, full, cut = tmp_path / "in.jsonl", tmp_path / "full.jsonl", tmp_path / "cut.jsonl"
    _write_jsonl(src, [_line(f"r{i}", COMPLETIONS, {"model": "a0" if i % 2 else model, "prompt": [1, 30 + i],
                                                     "max_tokens": 2 + i % 3, "ignore_eos": True})
                       for i in range(6)])
    flags = ("--enable-lora", "--lora-modules", f"a0={path}")
    assert _run(tiny_model, src, full, *flags) == 0
    lines = full.read_bytes().splitlines(keepends=True)
    cut.write_bytes(b"".join(lines[:2]) + lines[2][:40])
    (tmp_path / "cut.jsonl.options.json").write_bytes((tmp_path / "full.jsonl.options.json").read_bytes())
    assert _run(tiny_model, src, cut, "--resume", "--enable-lora", "--lora-modules", f"a0={adapter_dir(tiny_model, 2)}") == 2
    assert "--lora-modules" in capsys.readouterr().err
    assert _run(tiny_model, src, cut, "--resume", *flags) == 0

    def texts(path):
        return [(o["custom_id"], _ok_body(o)["choices"][0]["text"]) for o in _read(path)]

    assert texts(cut) == texts(full) and [c for c, _ in texts(full)] == [f"r{i}" for i in range(6)]
    assert cut.read_bytes().startswith(b"".join(lines[:2]))  # the kept lines as they were
    cut.write_text(json.dumps({"id": "r0", "outputs": []}) + "\n")  # a loraplex-format output line
    assert _run(tiny_model, src, cut, "--resume", *flags) == 2
    assert "line 1 of" in capsys.readouterr().err


def test_a_body_gets_the_servers_defaults_whatever_max_tokens_and_temperature_say(tiny_model, tmp_path, caplog):
    """No temperature: 1.0 (OpenAI's, vLLM's), sampled with the seed --seed and the custom_id give (as a loraplex line
    of that id at temperature 1.0); /v1/completions without max_tokens: 16; chat without one: the rest of the
    context. --max-tokens and --temperature are defaults of loraplex-format lines only (a warning says so)."""
    model = tiny_model["model_dir"]
    prompt, talk = [1, 40, 41, 42], [{"role": "user", "content": "Hello there"}]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(src, [_line("sampled", COMPLETIONS, {"model": model, "prompt": prompt, "max_tokens": 6,
                                                       "ignore_eos": True}),
                       _line("sixteen", COMPLETIONS, {"model": model, "prompt": prompt, "temperature": 0,
                                                       "ignore_eos": True}),
                       _line("rest", CHAT, {"model": model, "messages": talk, "temperature": 0, "ignore_eos": True})])
    own_src, own_dst = tmp_path / "own.jsonl", tmp_path / "own.out.jsonl"
    _write_jsonl(own_src, [{"id": "sampled", "prompt_token_ids": prompt,
                            "params": {"max_tokens": 6, "temperature": 1.0, "ignore_eos": True}}])
    assert _run(tiny_model, src, dst, "--max-model-len", "64", "--max-tokens", "3", "--temperature", "0") == 0
    assert "--max-tokens and --temperature: defaults of loraplex-format lines only" in caplog.text
    assert _run(tiny_model, own_src, own_dst, "--max-model-len", "64") == 0
    sampled, sixteen, rest = (_ok_body(o) for o in _read(dst))
    mine = _read(own_dst)[0]["outputs"][0]
    assert sampled["choices"][0]["text"] == mine["text"] and sampled["usage"]["completion_tokens"] == 6
    greedy = LLM(model, dtype="float32").generate({"prompt_token_ids": prompt},
                                                  SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert sampled["choices"][0]["text"] != greedy[0].outputs[0].text  # not greedy: --temperature 0 does not apply
    assert sixteen["usage"]["completion_tokens"] == 16
    assert rest["usage"]["prompt_tokens"] + rest["usage"]["completion_tokens"] == 64


def test_served_model_names_and_vllms_json_lora_modules(tiny_model, tmp_path, monkeypatch, capsys):
    """body.model names the base model by the server's id (--model's resolved directory name, whatever spelling or
    symlink --model used) or, given --served-model-name NAME..., by those names only (vLLM's flag); --lora-modules
    takes vLLM's JSON form beside NAME=PATH. Both are recorded with the run's options."""
    model_dir, path = tiny_model["model_dir"], adapter_dir(tiny_model, 0)
    served = Path(model_dir).name
    body = {"prompt": [1, 40, 41], "max_tokens": 2, "temperature": 0}
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(src, [_line("id", COMPLETIONS, {**body, "model": served})])
    monkeypatch.chdir(model_dir)
    assert main(["batch", str(src), str(dst), "--model", ".", "--dtype", "float32"]) == 0
    link = tmp_path / "linked-model"
    link.symlink_to(model_dir)
    assert main(["batch", str(src), str(dst), "--model", str(link), "--dtype", "float32", "--overwrite"]) == 0
    assert _ok_body(_read(dst)[0])["model"] == served

    _write_jsonl(src, [_line("first", COMPLETIONS, {**body, "model": "my-model"}),
                       _line("second", COMPLETIONS, {**body, "model": "other"}),
                       _line("dir", COMPLETIONS, {**body, "model": served}),
                       _line("json", COMPLETIONS, {**body, "model": "a0"})])
    flags = ("--served-model-name", "my-model", "other", "--enable-lora", "--lora-modules",
             json.dumps({"name": "a0", "path": path, "base_model_name": "my-model"}))
    assert _run(tiny_model, src, dst, "--overwrite", *flags) == 1
    first, second, by_dir, adapter = _read(dst)
    assert _ok_body(first)["choices"] == _ok_body(second)["choices"]
    assert by_dir["response"]["status_code"] == 404  # only the names given
    own_src, own_dst = tmp_path / "own.jsonl", tmp_path / "own.out.jsonl"
    _write_jsonl(own_src, [{"prompt_token_ids": [1, 40, 41], "params": {"max_tokens": 2},
                            "lora": {"name": "a0", "id": 1, "path": path}}])
    assert _run(tiny_model, own_src, own_dst, "--enable-lora") == 0
    assert _ok_body(adapter)["choices"][0]["text"] == _read(own_dst)[0]["outputs"][0]["text"]
    options = json.loads((tmp_path / "out.jsonl.options.json").read_text())
    assert options["served_model_name"] == ["my-model", "other"]
    assert options["lora_modules"] == [f"a0={os.path.realpath(path)}"]

    dst.write_text(dst.read_text().splitlines(keepends=True)[0])
    assert _run(tiny_model, src, dst, "--resume", "--served-model-name", "my-model", *flags[3:]) == 2
    assert "--served-model-name" in capsys.readouterr().err
    assert _run(tiny_model, src, dst, "--resume", *flags[:3], "--enable-lora", "--lora-modules", f"a0={path}") == 1
    assert [o["custom_id"] for o in _read(dst)] == ["first", "second", "dir", "json"]  # the same adapter, spelled
    for bad, needle in ((["--lora-modules", '{"name": "a0"'], "not JSON"),
                        (["--lora-modules", json.dumps({"name": "a0", "path": path, "rank": 8})], "'rank' is not a"),
                        (["--lora-modules", json.dumps({"name": "a0"})], 'needs "name" and "path"')):
        assert _run(tiny_model, src, tmp_path / "refused.jsonl", "--enable-lora", *bad) == 2
        assert needle in capsys.readouterr().err


def test_a_file_of_lines_with_custom_id_but_no_body_is_read_in_openai_format(tiny_model, tmp_path):
    """A line with custom_id, method or url is an OpenAI batch line, even one whose body is misspelled or missing:
    it fails naming body, instead of the file being read as loraplex's own format."""
    model = tiny_model["model_dir"]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(src, [{"custom_id": "r1", "method": "POST", "url": COMPLETIONS, "Body": {"model": model}},
                       {"custom_id": "r2", "method": "POST", "url": COMPLETIONS}])
    assert _run(tiny_model, src, dst) == 1
    first, second = _read(dst)
    assert (first["custom_id"], first["response"], first["error"]["code"]) == ("r1", None, "invalid_line")
    assert first["error"]["message"] == ("line 1: Body: not a field of an OpenAI batch line (its fields: custom_id, "
                                         "method, url, body; the request goes in body)")
    assert second["error"] == {"code": "invalid_line", "message": "line 2: body: missing; an OpenAI batch line "
                                                                   "holds its request (a JSON object) in body"}


def test_n_over_max_num_seqs_is_the_engines_refusal_and_resume_holds_max_num_seqs(tiny_model, tmp_path, capsys):
    """n=8 needs 8 sequences at once: with --max-num-seqs 4 the line is refused (naming the flag); so a --resume may
    not change --max-num-seqs, or it would fail lines the interrupted run would have run."""
    model = tiny_model["model_dir"]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(src, [_line(f"r{i}", COMPLETIONS, {"model": model, "prompt": [1, 40 + i], "max_tokens": 2, "n": 8})
                       for i in range(3)])
    assert _run(tiny_model, src, dst, "--max-num-seqs", "8") == 0
    dst.write_text(dst.read_text().splitlines(keepends=True)[0])
    assert _run(tiny_model, src, dst, "--resume", "--max-num-seqs", "4") == 2
    assert "--max-num-seqs 4 (earlier 8)" in capsys.readouterr().err
    assert _run(tiny_model, src, tmp_path / "small.jsonl", "--max-num-seqs", "4") == 1
    error = _read(tmp_path / "small.jsonl")[0]["response"]["body"]["error"]
    assert (error["param"], error["code"]) == ("n", "invalid_value")
    assert error["message"] == ("The request was refused: n: 8 samples need 8 sequences at once; the limit is "
                                "--max-num-seqs (4)")
