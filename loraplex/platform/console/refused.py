"""A refused form post, as the page it goes back to shows it: the fields the user typed (never secrets) filled
in again, and the field the error is about marked, with the error's message beside it.

The fields travel in the flash cookie of the redirect (see :func:`render.redirect`), so they are bounded.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from markupsafe import Markup

SECRET_FIELD = re.compile(r"key|secret|password|token|csrf|form_id", re.I)
TOKEN_COUNTS = frozenset({"tokens_per_minute", "monthly_token_quota"})  # numbers of tokens, not secrets
MAX_TYPED_VALUE = 1024  # characters per field carried back: the longest field (an adapter's description)
MAX_TYPED_TOTAL = 1500  # bytes of carried fields in all (the cookie stays well under browsers' 4 KB)


def carried(name: str) -> bool:
    """Whether a field of this name may travel in a cookie: never a key, a secret or the form's own tokens."""
    return len(name) <= 64 and (name in TOKEN_COUNTS or not SECRET_FIELD.search(name))


def typed_fields(form: dict[str, str] | None) -> dict[str, str]:
    """The non-secret fields of a submitted form, bounded, to fill the form in again after an error. A field
    that no longer fits the budget is left out (the form shows its saved value) rather than cut short."""
    out: dict[str, str] = {}
    size = 0
    for name, value in (form or {}).items():
        if not isinstance(value, str) or not carried(name):
            continue
        value = value[:MAX_TYPED_VALUE]
        cost = len(json.dumps([name, value], ensure_ascii=False).encode())
        if size + cost > MAX_TYPED_TOTAL:
            continue
        size += cost
        out[name] = value
    return out


@dataclass(frozen=True)
class Refused:
    """The form posted to ``action`` and refused with ``error`` about the field ``param``, as typed. Templates
    call :meth:`form` with each form's action: only the form that was refused gets the typed values back; any
    other (and every form when nothing was refused) shows the saved values the template passes."""

    action: str = ""
    fields: dict[str, str] = field(default_factory=dict)
    param: str | None = None
    error: str = ""

    def form(self, action: str) -> Refused:
        return self if self.action and action == self.action else Refused()

    def value(self, name: str, saved: object = "") -> str:
        """What the field shows: as typed when this form came back, else ``saved``."""
        if name in self.fields:
            return self.fields[name]
        return "" if saved is None else str(saved)

    def checked(self, name: str, default: bool) -> bool:
        """A checkbox: ticked as it was sent (a box left unticked is not sent) when this form came back."""
        return name in self.fields if self.action else default

    def invalid(self, name: str) -> bool:
        return bool(self.action) and self.param == name

    def aria(self, name: str, dom_id: str) -> Markup:
        """``aria-invalid`` and ``aria-describedby`` (the field's :meth:`message`) when the error is about it."""
        if not self.invalid(name):
            return Markup("")
        return Markup(' aria-invalid="true" aria-describedby="{}-error"').format(dom_id)

    def input(self, name: str, dom_id: str, saved: object = "") -> Markup:
        """The ``id`` (``dom_id``), ``name`` and ``value`` attributes of a text field, and its :meth:`aria`."""
        attrs = Markup('id="{}" name="{}" value="{}"').format(dom_id, name, self.value(name, saved))
        return attrs + self.aria(name, dom_id)

    def message(self, name: str, dom_id: str) -> Markup:
        """The error's message next to the field it is about (the one :meth:`aria` points to), else nothing."""
        if not self.invalid(name):
            return Markup("")
        return Markup('<p id="{}-error" class="field-error">{}</p>').format(dom_id, self.error)
