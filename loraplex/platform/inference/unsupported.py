"""Request fields this server does not honour are refused naming them, never silently ignored.

A client that asks for JSON output, tool calls, audio, web search or a reasoning effort and gets plain text back
as if it had worked is worse off than one told no: each such field is a 400 ``code=unsupported`` naming it. Its
do-nothing values are accepted (``null`` always, and those the tables below take), so a client that sends the
defaults explicitly still works.

Every field of OpenAI's chat and completions requests is declared in schemas.py, so none is dropped unread as an
unknown field: it is honoured, refused here (with its no-op values), or one of :data:`NO_OPS`, which change no
output and are accepted unread (docs/api.md lists both; tests/unit/platform/test_openai_fields.py checks the
``openai`` client's fields against the declared ones).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from loraplex.platform.errors import ApiError, bad_request
from loraplex.platform.inference import schemas as s

Accepts = Callable[[Any], bool]


def _never(_: Any) -> bool:
    return False


_NO_STRUCTURED_OUTPUT = (_never, "this server has no structured output")

# field -> (the values that ask for nothing this server lacks, why others cannot be honoured); null is always taken
_BOTH: dict[str, tuple[Accepts, str]] = {
    # OpenAI's chat field; vLLM takes it on completions too
    "response_format": (lambda v: v.get("type") == "text",
                        'this server has no structured output (JSON mode, JSON schema); only {"type": "text"} '
                        "is accepted"),
    # vLLM extensions
    "guided_json": _NO_STRUCTURED_OUTPUT, "guided_regex": _NO_STRUCTURED_OUTPUT,
    "guided_choice": _NO_STRUCTURED_OUTPUT, "guided_grammar": _NO_STRUCTURED_OUTPUT,
    "structured_outputs": _NO_STRUCTURED_OUTPUT,
    "use_beam_search": (lambda v: v is False, "this server has no beam search"),
    "spaces_between_special_tokens": (lambda v: v is True, "special tokens are detokenized as the tokenizer does; "
                                                           "only true is accepted"),
    "return_tokens_as_token_ids": (lambda v: v is False, "tokens are returned as text; only false is accepted"),
}
_CHAT: dict[str, tuple[Accepts, str]] = {
    "modalities": (lambda v: v == ["text"], 'this server generates text only; only ["text"] is accepted'),
    "audio": (_never, "this server generates no audio"),
    "prediction": (_never, "this server has no predicted outputs"),
    "web_search_options": (_never, "this server has no web search"),
    "reasoning_effort": (_never, "a model's reasoning effort cannot be set here (where the model's chat template "
                                 "has a switch, such as Qwen3's enable_thinking, send it in chat_template_kwargs)"),
    "verbosity": (_never, "a model's verbosity cannot be set here"),
    "moderation": (_never, "this server runs no moderation"),
    "service_tier": (lambda v: v in ("auto", "default"),
                     "this server has one service tier; only 'auto' and 'default' are accepted"),
    "store": (lambda v: v is False, "this server does not store completions (no stored completions, distillation "
                                    "or evals); only false is accepted"),
    "functions": (lambda v: v == [], "this server does not generate function calls"),
    "function_call": (lambda v: v == "none", "this server does not generate function calls; only 'none' is accepted"),
    # vLLM extensions
    "chat_template": (_never, "requests are rendered with the model's own template (a request's template would "
                              "run tenant-supplied code in the server)"),
    "echo": (lambda v: v is False, "echo is a /v1/completions parameter"),
}

# OpenAI fields taken and not read: none changes what is generated (user and safety_identifier are end-user ids for
# OpenAI's abuse monitoring, metadata tags stored completions, the prompt_cache_* fields tune OpenAI's cache hit
# rates (this server's prefix cache needs no key), parallel_tool_calls only matters with tool calls,
# stream_options.include_obfuscation pads stream chunks this server never pads)
NO_OPS = ("user", "safety_identifier", "metadata", "prompt_cache_key", "prompt_cache_retention",
          "prompt_cache_options", "parallel_tool_calls")
REFUSED = (*_BOTH, *_CHAT, "tools", "tool_choice", "stream_options", "prompt_logprobs")


def _unsupported(message: str, param: str) -> ApiError:
    return ApiError(400, message, param=param, code="unsupported")


def _shown(value: Any) -> str:
    """The value as JSON after the field's name in a refusal, when it is short (a dict or long list is not)."""
    text = msgspec.json.encode(value).decode()
    return f" {text}" if not isinstance(value, dict) and len(text) <= 40 else ""


def refuse_unsupported(req: s.CompletionRequest | s.ChatCompletionRequest) -> None:
    """A 400 naming the first field the request sets to something this server cannot honour."""
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true.", param="stream_options")
    if req.prompt_logprobs is not None and req.stream:
        raise _unsupported("prompt_logprobs is not available with stream=true (as in vLLM).", "prompt_logprobs")
    tables = (_BOTH, _CHAT) if isinstance(req, s.ChatCompletionRequest) else (_BOTH,)
    for table in tables:
        for param, (accepts, why) in table.items():
            value = getattr(req, param)
            if value is not None and not accepts(value):
                raise _unsupported(f"{param}{_shown(value)} is not supported: {why}.", param)
    if isinstance(req, s.ChatCompletionRequest):
        _refuse_tool_calls(req)


def _refuse_tool_calls(req: s.ChatCompletionRequest) -> None:
    """``tool_choice: "none"`` is accepted, and ``tools`` with it (they are then not shown to the model, as in
    vLLM); ``tools`` alone ask for tool calls (``tool_choice`` defaults to "auto" when tools are given)."""
    if req.tool_choice is not None and req.tool_choice != "none":
        shown = req.tool_choice if isinstance(req.tool_choice, str) else "a named function"
        raise _unsupported(f"tool_choice {shown!r} is not supported: this server does not generate tool "
                           "calls; only 'none' is accepted.", "tool_choice")
    if req.tools and req.tool_choice is None:
        raise _unsupported("tools need tool calling, which this server does not support (tool_choice defaults "
                           "to 'auto' when tools are given); send tool_choice 'none' to pass them anyway.", "tools")
