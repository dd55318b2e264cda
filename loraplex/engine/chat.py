"""Chat messages as the chat template gets them: the rules the server and ``LLM.chat`` share (no heavy imports)."""

from __future__ import annotations

# the roles a message may have, as the chat template sees them (the server's and LLM.chat's rules)
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


def chat_messages(conversation, where: str = "messages") -> list[dict]:
    """A conversation of message dicts as the server renders it: each role one of :data:`CHAT_ROLES`
    ("developer" as "system"), content a string, or text parts joined by newlines, or missing as ""; ``name`` kept.
    ValueError naming the message for anything else."""
    out = []
    for i, m in enumerate(conversation):
        at = f"{where}[{i}]"
        if not isinstance(m, dict):
            raise ValueError(f"{at}: a message must be a dict with 'role' and 'content', got {m!r:.80}")
        role = CHAT_ROLES.get(m.get("role"))
        if role is None:
            raise ValueError(f"{at}.role must be one of {sorted(CHAT_ROLES)}, got {m.get('role')!r}")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError(f"{at}.content: only text parts ({{'type': 'text', 'text': str}}) are "
                                     f"supported, got {part!r:.80}")
                parts.append(part["text"])
            content = "\n".join(parts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise ValueError(f"{at}.content must be a string or a list of text parts, got {content!r:.80}")
        message = {"role": role, "content": content}
        if m.get("name") is not None:
            message["name"] = m["name"]
        out.append(message)
    return out
