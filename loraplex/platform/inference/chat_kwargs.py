"""``chat_template_kwargs`` (vLLM extension): extra variables for the model's chat template.

Only variables the template reads pass (others could change nothing, and are dropped, as vLLM drops
them). Names the server sets itself are refused, naming them: every parameter of the tokenizer's
``apply_chat_template`` (``tokenize``, ``chat_template``, ``add_generation_prompt``, ``tools``, ...), the
template's ``messages`` and the tokenizer's special tokens (``bos_token``, ...). A client could otherwise
swap the template, skip the server's own switches or render someone else's conversation format.
"""

from __future__ import annotations

import functools
from typing import Any

import jinja2
import jinja2.meta

from loraplex.engine.chat import template_call_parameters
from loraplex.platform.errors import bad_request


@functools.lru_cache(maxsize=8)
def _template_variables(source: str) -> frozenset[str]:
    return frozenset(jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(source)))


def _reserved(tokenizer) -> set[str]:
    return (template_call_parameters(tokenizer) | {"messages", "additional_special_tokens"}
            | set(getattr(tokenizer, "special_tokens_map", {})))


def template_kwargs(tokenizer, kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """The request's ``chat_template_kwargs`` the template may see; 400 naming a reserved one."""
    if not kwargs:
        return {}
    reserved = _reserved(tokenizer)
    for key in kwargs:
        if key in reserved:
            raise bad_request(f"chat_template_kwargs cannot set {key!r}: the server sets it (use the request's own "
                              "parameters where there is one).", param=f"chat_template_kwargs.{key}")
    template = tokenizer.chat_template
    sources = template.values() if isinstance(template, dict) else [template]
    used = frozenset().union(*(_template_variables(src) for src in sources if src))
    return {k: v for k, v in kwargs.items() if k in used}
