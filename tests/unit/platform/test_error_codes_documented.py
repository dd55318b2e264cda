"""Every error ``code`` the inference routes can answer is in docs/api.md's error table: clients switch on
``code``, and one the docs never name is one no client handles (an engine refusal once said
``invalid_request``, a code documented nowhere)."""

from __future__ import annotations

import re
from pathlib import Path

from loraplex.platform import errors

ROOT = Path(__file__).resolve().parents[3]
# what a request to /v1/models, /v1/completions or /v1/chat/completions passes through
MODULES = ["errors.py", "middleware.py", "auth.py", "limits.py", "idempotency.py", "usage/quota.py",
           "inference/*.py"]
_CODE = re.compile(r'\bcode(?:: str)?\s*=\s*"([a-z_]+)"')


def _emitted() -> dict[str, str]:
    found = {code: "errors._CODES" for code in errors._CODES.values()}
    for pattern in MODULES:
        for path in sorted((ROOT / "loraplex" / "platform").glob(pattern)):
            for code in _CODE.findall(path.read_text()):
                found.setdefault(code, str(path.relative_to(ROOT)))
    return found


def _documented() -> set[str]:
    doc = (ROOT / "docs" / "api.md").read_text()
    section = doc[doc.index("## Errors"):doc.index("## OpenAI-compatible inference")]
    rows = [line.split("|") for line in section.splitlines() if re.match(r"\| \d{3} \|", line)]
    return {code.strip() for row in rows for code in row[3].split(",")}


def test_every_code_the_inference_routes_emit_is_documented():
    emitted = _emitted()
    assert {"invalid_value", "model_not_found", "engine_error", "unsupported"} <= set(emitted)  # the scan works
    missing = {code: where for code, where in emitted.items() if code not in _documented()}
    assert not missing, f"error codes missing from docs/api.md's table: {missing}"
