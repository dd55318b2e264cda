"""Online latency metrics: TTFT / TPOT / ITL / E2E, percentiles, goodput, Poisson send times."""

from __future__ import annotations

import random

import pytest

from loraplex.bench.online import RequestRecord, percentile, poisson_offsets, summarize


def _record(start, chunk_times, tokens=None, error=None):
    r = RequestRecord(start=start, error=error)
    if chunk_times:
        r.first_token, r.chunk_times, r.end = chunk_times[0], list(chunk_times), chunk_times[-1]
        r.output_tokens = tokens or len(chunk_times)
    return r


def test_per_request_metrics():
    r = _record(0.0, [0.5, 0.6, 0.8, 1.1])
    assert r.ttft == 0.5 and r.e2e == 1.1
    assert r.tpot == pytest.approx(0.6 / 3)
    assert r.itls == pytest.approx([0.1, 0.2, 0.3])


def test_percentile_interpolates():
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([0.0, 10.0], 90) == pytest.approx(9.0)


def test_summary_goodput_counts_only_requests_within_both_slos():
    records = [
        _record(0.0, [0.1, 0.2, 0.3]),  # meets both
        _record(0.0, [2.0, 2.1, 2.2]),  # TTFT too slow
        _record(0.0, [0.1, 1.1, 2.1]),  # TPOT too slow
        _record(0.0, [], error="HTTP 500"),
    ]
    s = summarize(records, duration=2.0, slo_ttft=1.0, slo_tpot=0.5)
    assert s["completed"] == 3 and s["failed"] == 1
    assert s["goodput_req_per_s"] == pytest.approx(0.5)
    assert s["output_tokens"] == 9 and s["output_tok_per_s"] == pytest.approx(4.5)
    assert s["ttft_s"]["p50"] == pytest.approx(0.1) and s["errors"] == ["HTTP 500"]


def test_poisson_offsets_have_the_requested_rate():
    offsets = poisson_offsets(4000, 8.0, random.Random(0))
    assert offsets[0] == 0.0 and offsets == sorted(offsets)
    assert 4000 / offsets[-1] == pytest.approx(8.0, rel=0.08)
    assert poisson_offsets(3, float("inf"), random.Random(0)) == [0.0, 0.0, 0.0]


def test_a_token_with_held_back_text_counts_as_arrived():
    from loraplex.bench.online import note_chunk

    r = RequestRecord(start=0.0)
    note_chunk(r, {"choices": [{"index": 0, "text": "", "logprobs": {"tokens": ["\ufffd"], "token_logprobs": [-1.0]}}]},
               0.25)
    note_chunk(r, {"choices": [{"index": 0, "text": "", "logprobs": None}]}, 0.3)  # nothing arrived
    note_chunk(r, {"choices": [{"index": 0, "text": "hé", "logprobs": {"tokens": ["h\u00e9"]}}]}, 0.4)
    note_chunk(r, {"choices": [], "usage": {"completion_tokens": 2, "prompt_tokens": 5}}, 0.5)
    assert r.ttft == 0.25 and r.chunk_times == [0.25, 0.4]
    assert (r.output_tokens, r.prompt_tokens) == (2, 5)


def test_loop_counters_send_the_metrics_token_when_the_environment_has_one(monkeypatch):
    """A server with LORAPLEX_METRICS_TOKEN answers /metrics only to that bearer token; the bench sends it."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from loraplex.bench.online import LOOP_COUNTERS, loop_counters

    token = "t" * 20
    body = "".join(f'{name}{{model_name="m"}} 3.0\n' for name in LOOP_COUNTERS).encode()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            ok = self.path == "/metrics" and self.headers.get("Authorization") == f"Bearer {token}"
            self.send_response(200 if ok else 401)
            self.end_headers()
            self.wfile.write(body if ok else b'{"error": {}}')

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        monkeypatch.delenv("LORAPLEX_METRICS_TOKEN", raising=False)
        assert loop_counters(url) is None
        monkeypatch.setenv("LORAPLEX_METRICS_TOKEN", token)
        assert loop_counters(url) == {name: 3.0 for name in LOOP_COUNTERS}
    finally:
        server.shutdown()
