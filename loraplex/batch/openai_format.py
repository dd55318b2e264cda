"""OpenAI's batch format for ``loraplex batch``, the lines OpenAI's Batch API and vLLM's ``run_batch`` read and write.

Input line: ``{"custom_id", "method": "POST", "url": "/v1/completions" | "/v1/chat/completions", "body"}``, the body a
request as the server takes it, ``model`` naming the base model or an adapter of ``--lora-modules``. Output line:
``{"id": "batch_req_...", "custom_id", "response": {"status_code": 200, "request_id", "body"}, "error": null}``, the
body a ``text_completion`` or ``chat.completion`` object as the server returns it. A line that fails has an
``error`` ``{"code", "message"}`` (the message starts with the line number and names the field), and a
``response`` as OpenAI writes a refused request: ``status_code`` 400 (404 for an unknown model, 500 when generation
failed) and an ``{"error": {"message", "type", "param", "code"}}`` body; a line that is no batch request (not
JSON, no custom_id, another method or url) has ``response`` null.

Body fields are the server's names (OpenAI's and vLLM's) and are checked by SamplingParams, which names the field;
a field this command does not act on is refused, never ignored: one that asks for something it does not do
(streaming, logprobs, tool calls, structured output) unless it has its no-op value, and one it does not know.
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass
from typing import Any

from loraplex.batch.own_format import NOT_AN_OBJECT, decode, line_seed, short, token_ids
from loraplex.batch.window import Line
from loraplex.engine.chat import ChatMessageError, chat_messages
from loraplex.engine.lora_request import LoRARequest
from loraplex.engine.outputs import RequestOutput
from loraplex.engine.sampling_params import SamplingParams, SamplingParamsError

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
URLS = (COMPLETIONS, CHAT)
ENVELOPE = ("custom_id", "method", "url", "body")
_LORAPLEX_FIELDS = frozenset({"id", "prompt", "prompt_token_ids", "params", "lora"})
# the codes of a line that is no batch request: its output line has no response
_LINE_CODES = frozenset({"invalid_json", "invalid_custom_id", "invalid_method", "invalid_url", "invalid_line"})
_STATUS = {"model_not_found": 404, "engine_error": 500}  # any other code of a refused body: 400

# body fields read as the SamplingParams field of the same name
_SAMPLING_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                    "repetition_penalty", "seed", "min_tokens", "stop", "stop_token_ids", "ignore_eos",
                    "include_stop_str_in_output", "skip_special_tokens", "logit_bias", "allowed_token_ids",
                    "bad_words")
# fields taken with their no-op value only (null is always taken, as if the field were not there):
# field -> (whether a value asks for nothing, what the command cannot do)
_NO_OP = {
    "stream": (lambda v: v is False, "a batch line's response is written whole, never streamed"),
    "stream_options": (lambda v: False, "a batch line's response is not streamed"),
    "echo": (lambda v: v is False, "batch lines do not echo their prompt"),
    "suffix": (lambda v: v == "", "no suffix (insertion) completions"),
    "logprobs": (lambda v: v is False, "OpenAI-format batch output has no logprobs (loraplex's own line format "
                                       "writes them: params.logprobs)"),
    "top_logprobs": (lambda v: False, "OpenAI-format batch output has no logprobs (loraplex's own line format "
                                      "writes them: params.logprobs)"),
    "prompt_logprobs": (lambda v: False, "OpenAI-format batch output has no logprobs (loraplex's own line format "
                                         "writes them: params.prompt_logprobs)"),
    "response_format": (lambda v: isinstance(v, dict) and v.get("type") == "text",
                        'no structured output; only {"type": "text"} is taken'),
    "tool_choice": (lambda v: v == "none", "no tool calls; only 'none' is taken"),
    "functions": (lambda v: v == [], "no tool calls (functions)"),
    "function_call": (lambda v: v == "none", "no tool calls; only 'none' is taken"),
}
# "user" is taken and not used (OpenAI's end-user id, for abuse monitoring)
_COMMON = frozenset({"model", "max_tokens", "user", "stream", "stream_options", "prompt_logprobs", *_SAMPLING_FIELDS})
_FIELDS = {
    COMPLETIONS: _COMMON | {"prompt", "echo", "best_of", "suffix", "logprobs"},
    CHAT: _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs",
                     "add_generation_prompt", "continue_final_message", "chat_template_kwargs", "response_format",
                     "tools", "tool_choice", "functions", "function_call"},
}


def is_request(item) -> bool:
    """Whether a decoded line is an OpenAI batch request (a file with one such line is read in this format)."""
    return item is not NOT_AN_OBJECT and "custom_id" in item and "body" in item


def line_id(item):
    """The line's ``custom_id`` as given (None where it has none): echoed in its output line."""
    return None if item is NOT_AN_OBJECT else item.get("custom_id")


@dataclass
class Context:
    """What every line of one run reads the same way."""

    defaults: dict  # SamplingParams fields a body does not set (the command's --max-tokens and --temperature)
    seed: int  # --seed: a body without a seed samples with line_seed(seed, custom_id)
    models: dict[str, LoRARequest | None]  # the names body.model may have: adapter, or None for the base model
    tokenizer: Any  # its chat template renders chat lines


@dataclass(frozen=True)
class Request:
    """What a line's output needs beside its outputs."""

    url: str
    model: str  # as the body named it (the response body carries it)
    role: str = "assistant"  # of the chat message generated
    param_names: tuple[tuple[str, str], ...] = ()  # engine field -> body field, for the engine's refusals


def models(model: str, lora_modules: list[str] | None, enable_lora: bool) -> dict[str, LoRARequest | None]:
    """The names body.model may have: ``--model`` as given or its directory's name (the base model, None), and the
    NAMEs of ``--lora-modules NAME=PATH`` (adapters, ids 1, 2, ... in the order given). ValueError naming the flag."""
    base = os.path.normpath(model)
    names: dict[str, LoRARequest | None] = dict.fromkeys((model, base, os.path.basename(base)))
    for value in lora_modules or ():
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules takes NAME=PATH (an adapter's name and its PEFT directory), got "
                             f"{value!r}")
        if name in names:
            what = "twice" if names[name] is not None else "as the base model's name (--model)"
            raise ValueError(f"--lora-modules names {name!r} {what}")
        if not os.path.isdir(path):
            raise ValueError(f"--lora-modules {value}: {path} is not a directory (a PEFT adapter's)")
        names[name] = LoRARequest(name, sum(r is not None for r in names.values()) + 1, path)
    if lora_modules and not enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    return names


class _Refused(ValueError):
    def __init__(self, param: str | None, message: str, code: str):
        super().__init__(message)
        self.param, self.code = param, code


def parse(seq: int, line_no: int, raw: bytes, ctx: Context) -> Line:
    """An OpenAI batch request line: what to run, or why it cannot run."""
    item, error = decode(line_no, raw)
    rid = line_id(item)
    if error is not None:
        return Line(seq, line_no, rid, error=error, error_code="invalid_json")
    try:
        url, body = _envelope(item)
        _refuse_unsupported(url, body)
        lora = _model(body, ctx)
        request, prompt = _prompt(url, body, ctx)
        params = _params(url, body, rid, ctx)
    except _Refused as exc:
        return Line(seq, line_no, rid, error=str(exc), error_param=exc.param, error_code=exc.code)
    return Line(seq, line_no, rid, prompt, params, lora, request=request)


def _envelope(item: dict) -> tuple[str, dict]:
    if not item.keys() & set(ENVELOPE) and item.keys() & _LORAPLEX_FIELDS:
        raise _Refused(None, "this line is in loraplex's own line format (id, prompt, params), but the input is in "
                             "OpenAI's batch format (a line has custom_id and body): one input holds one format",
                       "invalid_line")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        got = "none" if custom_id is None else short(custom_id)
        raise _Refused("custom_id", f"custom_id: every line needs one, a non-empty string (its output line carries "
                                    f"it), got {got}", "invalid_custom_id")
    if item.get("method") != "POST":
        raise _Refused("method", f"method: must be \"POST\", got {short(item.get('method'))}", "invalid_method")
    if item.get("url") not in URLS:
        raise _Refused("url", f"url: must be {' or '.join(URLS)}, got {short(item.get('url'))}", "invalid_url")
    unknown = sorted(item.keys() - set(ENVELOPE))
    if unknown:
        raise _Refused(unknown[0], f"{unknown[0]}: not a field of an OpenAI batch line (its fields: "
                                   f"{', '.join(ENVELOPE)}; the request goes in body)", "invalid_line")
    if not isinstance(item.get("body"), dict):
        raise _Refused("body", f"body: must be an object (the request), got {short(item.get('body'))}",
                       "invalid_line")
    return item["url"], item["body"]


def _refuse_unsupported(url: str, body: dict) -> None:
    if not isinstance(body.get("model"), str):
        raise _Refused("model", f"body.model: must be a string naming the model, got {short(body.get('model'))}",
                       "invalid_value")
    for field, value in body.items():
        if value is None:
            continue
        if field not in _FIELDS[url]:
            raise _Refused(field, f"body.{field}: not a field loraplex batch takes for {url}", "unsupported")
        if field in _NO_OP and not _NO_OP[field][0](value):
            raise _Refused(field, f"body.{field}: {short(value)} is not supported: {_NO_OP[field][1]}", "unsupported")
    if body.get("best_of") is not None and body["best_of"] != body.get("n", 1):
        raise _Refused("best_of", "body.best_of: not supported (use n)", "unsupported")
    if body.get("tools") and body.get("tool_choice") != "none":
        raise _Refused("tools", "body.tools: no tool calls (tool_choice defaults to 'auto' when tools are given); "
                                "send tool_choice 'none' to pass them anyway", "unsupported")


def _prompt(url: str, body: dict, ctx: Context) -> tuple[Request, str | dict]:
    if url == COMPLETIONS:
        return Request(url, body["model"]), _completion_prompt(body.get("prompt"))
    max_tokens = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    add_generation_prompt = body.get("add_generation_prompt") is not False  # vLLM's default: true
    ids = _chat_prompt(body, add_generation_prompt, ctx.tokenizer)
    # vLLM: a prompt that does not open an assistant turn is answered in the last message's role
    role = "assistant" if add_generation_prompt else body["messages"][-1].get("role")
    return Request(url, body["model"], role, (("prompt", "messages"), ("max_tokens", max_tokens))), \
        {"prompt_token_ids": ids}


def _completion_prompt(prompt) -> str | dict:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a list of one prompt
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise _Refused("prompt", f"body.prompt: {len(prompt)} prompts in one line; a batch line runs one prompt "
                                 "(give each its own line and custom_id)", "unsupported")
    if isinstance(prompt, list) and prompt:
        try:
            return {"prompt_token_ids": token_ids(prompt, "body.prompt")}
        except ValueError as exc:
            raise _Refused("prompt", str(exc), "invalid_value") from None
    raise _Refused("prompt", f"body.prompt: must be a string or a non-empty list of token ids, got {short(prompt)}",
                   "invalid_value")


def _chat_prompt(body: dict, add_generation_prompt: bool, tokenizer) -> list[int]:
    """The chat's prompt as the server renders it (chat_messages, then the tokenizer's chat template)."""
    from jinja2 import TemplateError

    from loraplex.engine.async_engine import chat_template_ids

    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _Refused("messages", f"body.messages: must be a non-empty list of messages, got {short(messages)}",
                       "invalid_value")
    if getattr(tokenizer, "chat_template", None) is None:
        raise _Refused("messages", "body.messages: the model has no chat template, so it cannot render messages; "
                                   f"send {COMPLETIONS} lines with a prompt instead", "unsupported")
    try:
        rendered = chat_messages(messages, "body.messages")
    except ChatMessageError as exc:
        raise _Refused(exc.param.removeprefix("body."), str(exc), "invalid_value") from None
    continue_final_message = body.get("continue_final_message") is True
    if add_generation_prompt and continue_final_message:
        raise _Refused("continue_final_message", "body.continue_final_message: cannot be combined with "
                       "add_generation_prompt, which defaults to true: send add_generation_prompt false",
                       "invalid_value")
    extra = body.get("chat_template_kwargs")
    if extra is not None and not isinstance(extra, dict):
        raise _Refused("chat_template_kwargs", f"body.chat_template_kwargs: must be an object, got {short(extra)}",
                       "invalid_value")
    try:
        return chat_template_ids(tokenizer, rendered, add_generation_prompt, continue_final_message, extra)
    except (TemplateError, ValueError, TypeError) as exc:
        raise _Refused("messages", f"body.messages: the model's chat template cannot render these messages: {exc}",
                       "invalid_value") from None


def _model(body: dict, ctx: Context) -> LoRARequest | None:
    if body["model"] not in ctx.models:
        names = ", ".join(repr(n) for n in ctx.models)
        raise _Refused("model", f"body.model: {short(body['model'])} is not a model of this run (the base model or "
                                f"an adapter of --lora-modules: {names})", "model_not_found")
    return ctx.models[body["model"]]


def _params(url: str, body: dict, custom_id: str, ctx: Context) -> SamplingParams:
    fields = {name: body[name] for name in _SAMPLING_FIELDS if body.get(name) is not None}
    max_param = "max_completion_tokens" if url == CHAT and body.get("max_completion_tokens") is not None \
        else "max_tokens"
    if body.get(max_param) is not None:
        fields["max_tokens"] = body[max_param]
    try:
        return SamplingParams(**{**ctx.defaults, "seed": line_seed(ctx.seed, custom_id), **fields})
    except SamplingParamsError as exc:
        param = max_param if exc.param == "max_tokens" else exc.param
        raise _Refused(param, f"body.{param}: {exc.detail}", "invalid_value") from None


# ---- output ------------------------------------------------------------------------------------------------

class OpenAIRecords:
    """Output lines in OpenAI's batch format."""

    def finished(self, line: Line, out: RequestOutput, failed: bool) -> dict:
        if failed:
            why = next(c.error for c in out.outputs if c.finish_reason == "error")
            return _error_record(line, f"generation failed: {why}", None, "engine_error")
        request: Request = line.request
        completion_tokens = sum(len(c.token_ids) for c in out.outputs)
        usage = {"prompt_tokens": len(out.prompt_token_ids), "completion_tokens": completion_tokens,
                 "total_tokens": len(out.prompt_token_ids) + completion_tokens,
                 "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens}}
        if request.url == COMPLETIONS:
            choices = [{"index": c.index, "text": c.text, "logprobs": None, "finish_reason": _finish_reason(c),
                        "stop_reason": c.stop_reason, "prompt_logprobs": None} for c in out.outputs]
            body = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": request.model,
                    "choices": choices, "usage": usage, "object": "text_completion", "system_fingerprint": None}
        else:
            choices = [{"index": c.index, "message": {"content": c.text, "role": request.role, "refusal": None},
                        "logprobs": None, "finish_reason": _finish_reason(c), "stop_reason": c.stop_reason}
                       for c in out.outputs]
            body = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": request.model,
                    "choices": choices, "usage": usage, "object": "chat.completion", "system_fingerprint": None,
                    "prompt_logprobs": None}
        return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.id,
                "response": {"status_code": 200, "request_id": uuid.uuid4().hex, "body": body}, "error": None}

    def refused(self, line: Line) -> dict:
        # no code: the engine refused the line (a prompt over --max-model-len, n over --max-num-seqs, ...)
        return _error_record(line, line.error, line.error_param, line.error_code or "invalid_value")


def _error_record(line: Line, message: str, param: str | None, code: str) -> dict:
    if not message.startswith(f"line {line.line_no} "):
        message = f"line {line.line_no}: {message}"
    response = None
    if code not in _LINE_CODES:
        if line.request is not None:
            param = dict(line.request.param_names).get(param, param)
        status = _STATUS.get(code, 400)
        kind = "server_error" if status >= 500 else "invalid_request_error"
        response = {"status_code": status, "request_id": uuid.uuid4().hex,
                    "body": {"error": {"message": message, "type": kind, "param": param, "code": code}}}
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.id, "response": response,
            "error": {"code": code, "message": message}}


def _finish_reason(comp) -> str:
    """As the server says it: "length" when max_tokens ended the sample, else "stop"."""
    return "length" if comp.finish_reason == "length" else "stop"


def output_failed(record: dict) -> bool:
    """Whether an output line of an earlier run (--resume) failed; KeyError/TypeError: it is no such line."""
    return record["error"] is not None or record["response"]["status_code"] != 200
