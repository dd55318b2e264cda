"""Session sealing, cookie flags, CSRF tokens and redirect targets (no app needed)."""

from __future__ import annotations

from loraplex.platform.console.pages_auth import _safe_next
from loraplex.platform.console.session import cookie_is_secure, login_token, open_key, seal_key, tokens_equal

KEY = "lpx-abcdefghijkl-" + "A1" * 20


def test_sealed_key_opens_only_with_its_session_id():
    sealed = seal_key("sid-one", KEY)
    assert KEY not in sealed and "sid-one" not in sealed
    assert open_key("sid-one", sealed) == KEY
    assert open_key("sid-two", sealed) != KEY
    # two sessions of the same key do not share a ciphertext
    assert seal_key("sid-two", KEY) != sealed


def test_secure_cookie_only_over_tls():
    assert not cookie_is_secure({"scheme": "http", "headers": []})
    assert cookie_is_secure({"scheme": "https", "headers": []})
    assert cookie_is_secure({"scheme": "http", "headers": [(b"x-forwarded-proto", b"https")]})
    assert not cookie_is_secure({"scheme": "http", "headers": [(b"x-forwarded-proto", b"http")]})


def test_login_token_is_bound_to_the_pre_session_cookie_and_secret():
    t = login_token(b"secret", "pre-1")
    assert tokens_equal(t, login_token(b"secret", "pre-1"))
    assert not tokens_equal(t, login_token(b"secret", "pre-2"))
    assert not tokens_equal(t, login_token(b"other", "pre-1"))
    assert not tokens_equal("", "") and not tokens_equal(None, t)


def test_next_never_leaves_the_console():
    assert _safe_next("/console/usage?range=7d") == "/console/usage?range=7d"
    for bad in ("https://evil.example/", "//evil.example/console", "/console//evil", "/admin/keys", "",
                None, "/console\\@evil", "/console/" + "x" * 400):
        assert _safe_next(bad) == "/console"
