"""OpenAI's batch format for ``loraplex batch``, the lines OpenAI's Batch API and vLLM's ``run_batch`` read and write.

Input line: ``{"custom_id", "method": "POST", "url": "/v1/completions" | "/v1/chat/completions", "body"}``, the body a
request as the server takes it, ``model`` naming the base model (its served names) or an adapter of
``--lora-modules``. A body is read by the server's own code (loraplex/platform/inference/plan.py, json_body.py):
the same fields taken, refused and ignored, the same limits, defaults and errors, word for word; and its response
body is rendered by the server's code (render.py), logprobs included. What the server does and a batch line cannot
carry is refused (``unsupported``): ``stream``, ``echo``, and several prompts in one line.

Output line, as OpenAI writes one: ``{"id": "batch_req_...", "custom_id", "response": {"status_code", "request_id",
"body"}, "error"}``. A request that ran or that the server would have answered with an error has a ``response``
(status 200 and a ``text_completion`` or ``chat.completion`` body; or the server's status and ``{"error":
{"message", "type", "param", "code"}}`` body) and ``"error": null``. A line that is no request (not JSON, no
custom_id, another method or url, no body) has ``"response": null`` and ``"error": {"code", "message"}``, the
message starting with the line number.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import msgspec

from loraplex.batch.own_format import NOT_AN_OBJECT, decode, line_seed, short
from loraplex.batch.window import Line
from loraplex.engine.chat import chat_template_ids
from loraplex.engine.config import served_model_id
from loraplex.engine.lora_request import LoRARequest
from loraplex.engine.outputs import RequestOutput
from loraplex.engine.protocol import TokenDelta
from loraplex.engine.token_bytes import TokenBytes
from loraplex.platform.errors import ApiError, model_not_found
from loraplex.platform.inference import plan, render
from loraplex.platform.inference import schemas as s
from loraplex.platform.inference.validation import Limits, require_model
from loraplex.platform.json_body import convert_body

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
URLS = (COMPLETIONS, CHAT)
ENVELOPE = ("custom_id", "method", "url", "body")
_BODY_TYPES = {COMPLETIONS: s.CompletionRequest, CHAT: s.ChatCompletionRequest}
_LORAPLEX_FIELDS = frozenset({"id", "prompt", "prompt_token_ids", "params", "lora"})


def is_request(item) -> bool:
    """Whether a decoded line is meant as an OpenAI batch request: it has a field of the envelope (a file with one
    such line is read in this format; a line without ``body`` then fails naming it)."""
    return item is not NOT_AN_OBJECT and any(key in item for key in ENVELOPE)


def line_id(item):
    """The line's ``custom_id`` as given (None where it has none): echoed in its output line."""
    return None if item is NOT_AN_OBJECT else item.get("custom_id")


# ---- the names body.model may have ------------------------------------------------------------------


def base_model_names(model: str, served_model_names: list[str] | None) -> list[str]:
    """The names of the base model, the first one shown in messages: ``--served-model-name`` (vLLM's flag) where
    given; else the server's id of ``--model`` and ``--model`` as given (vLLM's default)."""
    if served_model_names:
        return list(dict.fromkeys(served_model_names))
    return list(dict.fromkeys((served_model_id(model), model)))


@dataclass(frozen=True)
class LoraModule:
    name: str
    path: str
    base_model_name: str | None = None  # vLLM's JSON form may name it; kept on the LoRARequest (one base model here)


def lora_module(value: str) -> LoraModule:
    """One ``--lora-modules`` value, in either of vLLM's forms: ``NAME=PATH`` or ``{"name", "path",
    "base_model_name"}`` (JSON). ValueError naming the flag."""
    if value.lstrip().startswith("{"):
        try:
            fields = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"--lora-modules {value}: not JSON ({exc})") from None
        if not isinstance(fields, dict) or not {"name", "path"} <= fields.keys():
            raise ValueError(f'--lora-modules {value}: a JSON value needs "name" and "path"')
        unknown = sorted(fields.keys() - {"name", "path", "base_model_name"})
        if unknown:
            raise ValueError(f"--lora-modules {value}: {unknown[0]!r} is not a field of a LoRA module "
                             "(name, path, base_model_name)")
        if not all(isinstance(fields.get(k), str) and fields[k] for k in ("name", "path")) or \
                not isinstance(fields.get("base_model_name", ""), str):
            raise ValueError(f"--lora-modules {value}: name, path and base_model_name must be strings")
        return LoraModule(fields["name"], fields["path"], fields.get("base_model_name"))
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules takes NAME=PATH or vLLM's JSON form '{{\"name\": ..., \"path\": ...}}' "
                         f"(an adapter's name and its PEFT directory), got {value!r}")
    return LoraModule(name, path)


def models(model: str, served_model_names: list[str] | None, lora_modules: list[str] | None,
           enable_lora: bool) -> dict[str, LoRARequest | None]:
    """The names body.model may have: the base model's (:func:`base_model_names`, None) and the adapters of
    ``--lora-modules`` (ids 1, 2, ... in the order given). ValueError naming the flag."""
    names: dict[str, LoRARequest | None] = dict.fromkeys(base_model_names(model, served_model_names))
    for value in lora_modules or ():
        module = lora_module(value)
        if module.name in names:
            what = "twice" if names[module.name] is not None else "as a name of the base model"
            raise ValueError(f"--lora-modules names {module.name!r} {what}")
        if not os.path.isdir(module.path):
            raise ValueError(f"--lora-modules {value}: {module.path} is not a directory (a PEFT adapter's)")
        names[module.name] = LoRARequest(module.name, sum(r is not None for r in names.values()) + 1, module.path,
                                         base_model_name=module.base_model_name)
    if lora_modules and not enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    return names


# ---- input ------------------------------------------------------------------------------------------


class LineError(Exception):
    """A line that is no batch request (no HTTP request could be made of it): its output line has no response."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code, self.message = code, message


@dataclass
class Request:
    """What a line's response needs beside the engine's deltas, and its choices as the deltas come."""

    url: str
    model: str  # as the body named it (the response body carries it)
    prompt_ids: list[int]
    param_names: dict[str, str]  # engine field -> body field, for the engine's refusals
    role: str = "assistant"  # of the chat message generated
    top_n: int = 0  # chat: alternatives per token's logprobs
    chat_logprobs: bool = False  # chat: logprobs asked for
    prompt_logprobs: bool = False  # vLLM's prompt_logprobs asked for
    choices: list[render.ChoiceAccumulator] = field(default_factory=list)


@dataclass
class Context:
    """What every line of one run reads the same way."""

    seed: int  # --seed: a body without a seed samples with line_seed(seed, custom_id)
    models: dict[str, LoRARequest | None]  # the names body.model may have: adapter, or None for the base model
    base_model_id: str  # the base model's first name (messages name it)
    limits: Limits  # the server's request limits (its settings) and the engine's max_model_len
    tokenizer: Any
    vocab_size: int
    refusal_text: Callable[[str], str] = str  # the engine's refusal as the line's error says it (naming flags)


class OpenAIFormat:
    """OpenAI's batch lines (window.LineFormat)."""

    def __init__(self, ctx: Context):
        self.ctx = ctx
        # what render.py reads of the server's engine client to name tokens in logprobs
        self._tokens = SimpleNamespace(tokenizer=ctx.tokenizer, token_bytes=TokenBytes(ctx.tokenizer))

    def parse(self, seq: int, line_no: int, raw: bytes) -> Line:
        item, error = decode(line_no, raw)
        rid = line_id(item)
        if error is not None:
            return Line(seq, line_no, rid, error=LineError("invalid_json", error))
        try:
            url, body = _envelope(item, line_no)
            request, params, lora = self._request(url, body, rid)
        except (LineError, ApiError) as exc:
            return Line(seq, line_no, rid, error=exc)
        return Line(seq, line_no, rid, {"prompt_token_ids": request.prompt_ids}, params, lora, request=request)

    def line_id(self, line_no: int, raw: bytes) -> Any:
        return line_id(decode(line_no, raw)[0])

    def _request(self, url: str, body: Any, custom_id: str):
        """The server's reading of ``body`` (routes.py's order): (Request, SamplingParams, adapter)."""
        ctx = self.ctx
        req = convert_body(body, _BODY_TYPES[url], "POST", url)
        require_model(req.model)
        if req.model not in ctx.models:
            raise model_not_found(req.model)
        if url == COMPLETIONS:
            plan.check_completion(req)
            _refuse_what_a_batch_line_cannot_carry(req)
            items = plan.completion_prompt_items(req, ctx.vocab_size)
            if len(items) > 1:
                raise ApiError(400, f"prompt holds {len(items)} prompts: a loraplex batch line runs one (give each "
                                    "its own line and custom_id).", param="prompt", code="unsupported")
            prompts = [ctx.tokenizer.encode(x) if isinstance(x, str) else x for x in items]
            prompts, _ = plan.truncate_prompts(prompts, [None], req.truncate_prompt_tokens, ctx.limits.max_model_len)
            outputs = plan.completion_outputs(req)
            params = plan.engine_params(req, prompts, ctx.limits, ctx.vocab_size, max_tokens=outputs.max_tokens,
                                        max_tokens_param="max_tokens", prompt_param="prompt",
                                        logprobs=outputs.logprobs, prompt_logprobs=outputs.prompt_logprobs)
            request = Request(url, req.model, prompts[0], {"prompt": "prompt", "max_tokens": "max_tokens"},
                              prompt_logprobs=req.prompt_logprobs is not None)
        else:
            top_n = plan.check_chat(req)
            _refuse_what_a_batch_line_cannot_carry(req)
            call = plan.chat_template_call(req, ctx.tokenizer, ctx.base_model_id)
            try:
                ids = chat_template_ids(ctx.tokenizer, *call.args())
            except plan.TEMPLATE_ERRORS as exc:
                raise plan.template_refusal(exc) from None
            prompts, _ = plan.truncate_prompts([ids], [None], req.truncate_prompt_tokens, ctx.limits.max_model_len)
            max_tokens, param = plan.chat_max_tokens(req)
            params = plan.engine_params(req, prompts, ctx.limits, ctx.vocab_size, max_tokens=max_tokens,
                                        max_tokens_param=param, prompt_param="messages",
                                        logprobs=top_n if req.logprobs else None,
                                        prompt_logprobs=req.prompt_logprobs)
            request = Request(url, req.model, prompts[0], {"prompt": "messages", "max_tokens": param},
                              plan.chat_role(req), top_n, bool(req.logprobs), req.prompt_logprobs is not None)
        if params.seed is None:  # reproducible, and the same when --resume runs it (the server's would be random)
            params = dataclasses.replace(params, seed=line_seed(ctx.seed, custom_id))
        request.choices = [render.ChoiceAccumulator() for _ in range(params.n)]
        return request, params, ctx.models[req.model]

    # ---- output --------------------------------------------------------------------------------------

    def observe(self, line: Line, delta: TokenDelta) -> None:
        """Each delta goes to its choice as the server's route takes it (text, logprobs, prompt logprobs)."""
        request: Request = line.request
        acc = request.choices[delta.index]
        if request.url == COMPLETIONS:
            acc.add_completion_delta(self._tokens, delta)
        else:
            acc.add_chat_delta(self._tokens, delta, request.top_n)
        if delta.prompt_logprobs is not None and request.prompt_logprobs:
            acc.prompt_logprobs = render.vllm_prompt_logprobs(request.prompt_ids, delta.prompt_logprobs)

    def finished(self, line: Line, out: RequestOutput, failed: bool) -> dict:
        if failed:  # as the server answers a generation that failed (an adapter that cannot be loaded)
            why = next(c.error for c in out.outputs if c.finish_reason == "error")
            return _record(line, plan.engine_failed(self.ctx.refusal_text(why or "engine error")))
        request: Request = line.request
        completion_tokens = sum(len(c.token_ids) for c in out.outputs)
        usage = render.usage(len(out.prompt_token_ids), completion_tokens, out.num_cached_tokens)
        created = int(time.time())
        if request.url == COMPLETIONS:
            body = s.CompletionResponse(id=f"cmpl-{uuid.uuid4().hex}", created=created, model=request.model,
                                        usage=usage, choices=render.completion_choices(request.choices))
        else:
            body = s.ChatCompletionResponse(id=f"chatcmpl-{uuid.uuid4().hex}", created=created, model=request.model,
                                            usage=usage, prompt_logprobs=request.choices[0].prompt_logprobs,
                                            choices=render.chat_choices(request.choices, request.role,
                                                                        request.chat_logprobs))
        return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.id,
                "response": {"status_code": 200, "request_id": uuid.uuid4().hex, "body": msgspec.to_builtins(body)},
                "error": None}

    def refused(self, line: Line) -> dict:
        return _record(line, line.error)

    def engine_refused(self, line: Line, exc: ValueError) -> ApiError:
        text, param = plan.refusal_text(exc, line.request.param_names)
        return plan.refused(self.ctx.refusal_text(text), param)

    def crashed(self, exc: Exception) -> ApiError:
        # the server's answer to a defect (errors.py: 500 internal_error), saying what failed: a local run's user
        # is also its operator
        return ApiError(500, f"loraplex batch failed on this request: {type(exc).__name__}: {exc} (a defect, "
                             "logged with its traceback)", type="server_error", code="internal_error")


def _envelope(item: dict, line_no: int) -> tuple[str, Any]:
    def fail(code: str, message: str) -> LineError:
        return LineError(code, f"line {line_no}: {message}")

    if not item.keys() & set(ENVELOPE) and item.keys() & _LORAPLEX_FIELDS:
        raise fail("invalid_line", "this line is in loraplex's own line format (id, prompt, params), but the input is "
                                   "in OpenAI's batch format (a line has custom_id, method, url or body): one input "
                                   "holds one format")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        got = "none" if custom_id is None else short(custom_id)
        raise fail("invalid_custom_id", f"custom_id: every line needs one, a non-empty string (its output line "
                                        f"carries it), got {got}")
    if item.get("method") != "POST":
        raise fail("invalid_method", f"method: must be \"POST\", got {short(item.get('method'))}")
    if item.get("url") not in URLS:
        raise fail("invalid_url", f"url: must be {' or '.join(URLS)}, got {short(item.get('url'))}")
    unknown = sorted(item.keys() - set(ENVELOPE))
    if unknown:
        raise fail("invalid_line", f"{unknown[0]}: not a field of an OpenAI batch line (its fields: "
                                   f"{', '.join(ENVELOPE)}; the request goes in body)")
    if item.get("body") is None:
        raise fail("invalid_line", "body: missing; an OpenAI batch line holds its request (a JSON object) in body")
    return item["url"], item["body"]


def _refuse_what_a_batch_line_cannot_carry(req) -> None:
    """Fields the server honours whose answer has no place in a batch output line; their no-op values are taken."""
    chat = isinstance(req, s.ChatCompletionRequest)
    refused = (("stream", req.stream, "a batch line's response is written whole, never streamed"),
               ("echo", None if chat else req.echo, "batch lines do not echo their prompt"))
    for param, asked, why in refused:
        if asked:
            raise ApiError(400, f"{param} is not supported by loraplex batch: {why}.", param=param,
                           code="unsupported")


def _record(line: Line, error: ApiError | LineError) -> dict:
    """A line that failed: the server's error response for a request it refused (``"error": null``, as OpenAI
    writes a request that got an HTTP response), or no response and the line's ``error``."""
    record = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.id}
    if isinstance(error, LineError):
        return {**record, "response": None, "error": {"code": error.code, "message": error.message}}
    body = {"error": {"message": error.message, "type": error.type, "param": error.param, "code": error.code}}
    return {**record, "response": {"status_code": error.status_code, "request_id": uuid.uuid4().hex, "body": body},
            "error": None}


def output_failed(record: dict) -> bool:
    """Whether an output line of an earlier run (--resume) failed; KeyError/TypeError: it is no such line."""
    return record["error"] is not None or record["response"]["status_code"] != 200
