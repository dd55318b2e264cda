"""The online section of a report names why requests failed, and where the server ran its engine loop."""

from __future__ import annotations

from loraplex.bench.online import RequestRecord, summarize
from loraplex.bench.sections import online_section


def _result(records, server=None):
    return {"rate": 30.0, "popularity": "uniform", "input_len": 4, "output_len": 2, "adapters": [],
            "summary": summarize(records, 1.0, 1.0, 0.1), "server": server}


def test_failed_requests_show_their_errors_and_a_clean_run_shows_none():
    ok = RequestRecord(start=0.0, first_token=0.1, end=0.3, chunk_times=[0.1, 0.3], output_tokens=2, prompt_tokens=4)
    bad = RequestRecord(start=0.0, error="HTTP 429: rate limit: tokens per minute")
    _, text = online_section(_result([ok, bad, bad]))
    assert "(1 completed, 2 failed)" in text
    assert "The failed requests' errors (1 distinct shown): `HTTP 429" in text
    _, clean = online_section(_result([ok]))
    assert "errors" not in clean
