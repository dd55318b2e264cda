"""Chat messages as the chat template gets them: the rules the server and ``LLM.chat`` share (no heavy imports)."""

from __future__ import annotations

import inspect

# the roles a message may have, as the chat template sees them
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


class ChatMessageError(ValueError):
    """A message the template cannot take; ``param`` names it (``messages[i].role`` / ``messages[i].content``)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def chat_messages(conversation, where: str = "messages") -> list[dict]:
    """A conversation of message dicts as the server renders it: each role one of :data:`CHAT_ROLES`
    ("developer" as "system"), content a string, or text parts joined by newlines (as vLLM joins them for a template
    that expects a string), or missing as ""; ``name`` kept (some templates show speaker names).
    :class:`ChatMessageError` naming the message for anything else."""
    out = []
    for i, m in enumerate(conversation):
        at = f"{where}[{i}]"
        if not isinstance(m, dict):
            raise ChatMessageError(f"{at}: a message must be a dict with 'role' and 'content', got {m!r:.80}", at)
        role = CHAT_ROLES.get(m.get("role"))
        if role is None:
            raise ChatMessageError(f"{at}.role must be one of {sorted(CHAT_ROLES)}, got {m.get('role')!r}.",
                                   f"{at}.role")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    raise ChatMessageError(f"{at}.content: only text parts are supported (got {kind!r}).",
                                           f"{at}.content")
                if not isinstance(part.get("text"), str):
                    raise ChatMessageError(f"{at}.content: a part of type 'text' needs a 'text' string.",
                                           f"{at}.content")
                parts.append(part["text"])
            content = "\n".join(parts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise ChatMessageError(f"{at}.content must be a string or a list of text parts, got {content!r:.80}",
                                   f"{at}.content")
        message = {"role": role, "content": content}
        if m.get("name") is not None:
            message["name"] = m["name"]
        out.append(message)
    return out


def template_call_parameters(tokenizer) -> set[str]:
    """The named parameters of the tokenizer's ``apply_chat_template`` (``tokenize``, ``add_generation_prompt``,
    ``tools``, ...): the caller sets them, so ``chat_template_kwargs`` (template variables) cannot."""
    params = inspect.signature(tokenizer.apply_chat_template).parameters.values()
    return {p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}


def chat_template_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                      continue_final_message: bool = False, template_kwargs: dict | None = None) -> list[int]:
    """The prompt's token ids from the tokenizer's chat template. ``template_kwargs``: extra template variables (the
    caller keeps out the tokenizer's own parameters)."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                        continue_final_message=continue_final_message, tokenize=True,
                                        **(template_kwargs or {}))
    if hasattr(ids, "keys"):  # a BatchEncoding in newer transformers
        ids = ids["input_ids"]
    return list(ids)
