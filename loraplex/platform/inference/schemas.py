"""OpenAI wire types (msgspec).

Every field of OpenAI's requests is declared: honoured, refused with its no-op values taken, or taken unread where
it changes no output (unsupported.py). Other unknown fields (vLLM extensions not declared) are ignored."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

# ---- requests -------------------------------------------------------------------------------------


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = False
    include_obfuscation: bool | None = None  # taken unread: chunks are never padded


class _SamplingFields(msgspec.Struct, kw_only=True):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    user: str | None = None  # taken unread (unsupported.NO_OPS)
    logit_bias: dict[str, float] | None = None  # token id (a decimal string) -> bias in [-100, 100]
    # vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    prompt_logprobs: int | None = None  # not with stream (as vLLM)
    truncate_prompt_tokens: int | None = None  # keep the prompt's last N tokens (-1: max_model_len)
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] | None = None  # never completed
    # declared only to be refused, their no-op values taken (unsupported.py): OpenAI's chat field (vLLM takes it on
    # completions too), vLLM extensions
    response_format: dict[str, Any] | None = None
    spaces_between_special_tokens: bool | None = None  # true (the default) accepted
    return_tokens_as_token_ids: bool | None = None  # false accepted
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    use_beam_search: bool | None = None


class CompletionRequest(_SamplingFields, kw_only=True):
    # a string, a list of strings, a list of token ids, or a list of token-id lists
    prompt: str | list[str | int | list[int]]
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None


class TextPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    # left out (UNSET) or null only on an assistant message with tool_calls or function_call (validation.py)
    content: str | list[TextPart] | None | msgspec.UnsetType = msgspec.UNSET
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    function_call: dict[str, Any] | None = None


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    # OpenAI fields refused, their no-op values taken (unsupported.py)
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    moderation: dict[str, Any] | None = None
    service_tier: str | None = None
    store: bool | None = None
    # OpenAI fields taken unread: they change no output (unsupported.NO_OPS)
    metadata: dict[str, str] | None = None
    parallel_tool_calls: bool | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    # vLLM extensions: chat template switches (continue_final_message: assistant prefill)
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables (chat_kwargs.py)
    # refused (unsupported.py): a client's own template (see docs/api.md), echo of the last message
    chat_template: Any = None
    echo: bool | None = None


# ---- responses ------------------------------------------------------------------------------------


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(msgspec.Struct):
    """vLLM's ``Logprob``: one candidate of a prompt position."""

    logprob: float
    rank: int | None
    decoded_token: str


# vLLM's prompt_logprobs: per prompt token, the token itself and the top-N candidates by id (None for the first)
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None  # vLLM: the stop token id or stop string that ended the choice
    prompt_logprobs: PromptLogprobs | None = None  # vLLM extension, not streamed


class CompletionResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    object: Literal["text_completion"] = "text_completion"
    system_fingerprint: str | None = None


class TopLogprobOut(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatLogprobEntry(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprobOut]


class ChatLogprobs(msgspec.Struct):
    content: list[ChatLogprobEntry] | None


class AssistantMessage(msgspec.Struct):
    content: str | None
    role: str = "assistant"  # with add_generation_prompt=false: the last message's role (as vLLM)
    refusal: str | None = None


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None


class ChatCompletionResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    object: Literal["chat.completion"] = "chat.completion"
    system_fingerprint: str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM extension (the prompt is shared by the choices)


class ChatDelta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"


class CompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    object: Literal["text_completion"] = "text_completion"


class Model(msgspec.Struct):
    id: str
    created: int
    owned_by: str
    root: str | None = None
    parent: str | None = None
    object: Literal["model"] = "model"


class ModelList(msgspec.Struct):
    data: list[Model]
    object: Literal["list"] = "list"

