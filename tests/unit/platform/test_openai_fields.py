"""Every field of OpenAI's chat and completions requests is declared in the server's request types, so none is
dropped unread as an unknown field: each is honoured, accepted as a documented no-op, or refused naming it
(unsupported.py). The list comes from the installed ``openai`` client: a field OpenAI adds fails here until the
server decides what to do with it."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from openai.types import completion_create_params as completion_params
from openai.types.chat import chat_completion_stream_options_param as stream_options_params
from openai.types.chat import completion_create_params as chat_params

from loraplex.platform.inference import schemas as s
from loraplex.platform.inference import unsupported

DOC = (Path(__file__).resolve().parents[3] / "docs" / "api.md").read_text()


def _declared(struct) -> set[str]:
    return {f.name for f in msgspec.structs.fields(struct)}


@pytest.mark.parametrize(("openai_type", "struct"), [
    (chat_params.CompletionCreateParamsBase, s.ChatCompletionRequest),
    (completion_params.CompletionCreateParamsBase, s.CompletionRequest),
    (stream_options_params.ChatCompletionStreamOptionsParam, s.StreamOptions),
])
def test_every_field_of_openais_requests_is_declared(openai_type, struct):
    missing = set(openai_type.__annotations__) - _declared(struct)
    assert not missing, f"OpenAI fields {struct.__name__} would drop unread: {sorted(missing)}"


def test_fields_refused_or_accepted_as_no_ops_are_in_the_docs_table():
    section = DOC[DOC.index("### Parameters this server does not honour"):DOC.index("### Responses")]
    listed = {name for name in unsupported.REFUSED + unsupported.NO_OPS if f"`{name}`" not in section}
    assert not listed, f"missing from docs/api.md's table of parameters: {sorted(listed)}"
    both = set(unsupported.REFUSED) & set(unsupported.NO_OPS)
    assert not both, f"a field is either refused (with its no-op values) or a no-op: {sorted(both)}"
    for name in unsupported.REFUSED + unsupported.NO_OPS:
        assert name in _declared(s.ChatCompletionRequest) | _declared(s.CompletionRequest), name
