"""``Idempotency-Key`` validation and request fingerprints."""

from __future__ import annotations

import pytest

from loraplex.platform import idempotency as idem
from loraplex.platform.errors import ApiError


@pytest.mark.parametrize("value", ["", "x" * 256, "tab\there", "caf\u00e9", "nul\x00"])
def test_bad_keys_are_400_naming_the_header(value):
    with pytest.raises(ApiError) as err:
        idem.check_key(value)
    assert err.value.status_code == 400 and err.value.param == "Idempotency-Key"


@pytest.mark.parametrize("value", ["a", "x" * 255, "order 42/retry:1 ~!"])
def test_printable_ascii_keys_up_to_255_are_accepted(value):
    assert idem.check_key(value) == value


def test_json_fingerprint_ignores_key_order_and_whitespace_but_not_values():
    a = idem.json_body_sha256(b'{"model": "m", "prompt": "hi", "max_tokens": 3}')
    b = idem.json_body_sha256(b'{"max_tokens":3,"prompt":"hi","model":"m"}')
    c = idem.json_body_sha256(b'{"max_tokens":4,"prompt":"hi","model":"m"}')
    assert a == b != c
    assert idem.fingerprint("POST", "/v1/completions", a) != idem.fingerprint("POST", "/v1/chat/completions", a)


def test_scopes_never_contain_the_raw_key_and_differ_per_tenant():
    a = idem.IdempotencyStore.scope("tenant-a", "completions", "secret-order-7")
    b = idem.IdempotencyStore.scope("tenant-b", "completions", "secret-order-7")
    assert a != b and "secret-order-7" not in a


def test_a_body_nested_deeper_than_json_can_recurse_still_has_a_fingerprint():
    """msgspec decodes a body nested ~980 levels deep, Python's json (from the handler's deeper stack) does not:
    the fingerprint then falls back to the bytes as sent instead of failing the request with a 500."""
    deep = b'{"model": "m", "meta": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert idem.json_body_sha256(deep) == idem.json_body_sha256(deep) != idem.json_body_sha256(deep + b" ")
