"""Shutdown past its limits, on a real ``loraplex serve`` (embedded default, engine in its own process):

- requests still running when ``drain_timeout_s`` has passed end with a 503 ``draining`` (JSON) or an error
  event (stream) sent by the app, not cut by uvicorn's own timeout, and are billed as errors, a JSON response
  none of its tokens (its client got none);
- a second Ctrl-C quits at once and stops the engine process (it used to leave the server waiting forever for
  an engine child nobody had told to stop)."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import threading
import time

import httpx

from tests.e2e.server import start_server

LONG = 4000  # tokens: many seconds of the tiny model on a CPU, far past the drain timeout below


def _children(pid: int) -> set[int]:
    out: set[int] = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children") as f:
            out.update(int(x) for x in f.read().split())
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _cmdline(pid: int) -> bytes:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read()  # the engine runs multiprocessing's spawn_main; its resource tracker does not


def _running(srv) -> float:
    text = httpx.get(srv.base_url + "/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("vllm:num_requests_running{"))


def _stream_until_first_token(srv, key: str, model: str, events: list[dict], started: threading.Event,
                              errors: list[BaseException]) -> None:
    body = {"model": model, "prompt": "go", "max_tokens": LONG, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    try:
        with httpx.Client(base_url=srv.base_url, timeout=60, headers={"Authorization": f"Bearer {key}"}) as c, \
                c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
                    started.set()
                elif line == "data: [DONE]":
                    events.append({"done": True})
    except BaseException as exc:  # noqa: BLE001 (reported by the test)
        errors.append(exc)
        started.set()


def test_requests_past_the_drain_timeout_end_with_503_draining_and_are_billed_as_errors(tmp_path, tiny_model):
    srv = start_server(tmp_path / "data", demo_model_from=tiny_model["model_dir"],
                       env={"LORAPLEX_DRAIN_TIMEOUT_S": "1"})
    try:
        tenant = srv.create_tenant("late")
        key = tenant["key"]
        model = srv.client(key).get("/v1/models").json()["data"][0]["id"]
        events: list[dict] = []
        started, errors = threading.Event(), []
        streamer = threading.Thread(target=_stream_until_first_token,
                                    args=(srv, key, model, events, started, errors))
        streamer.start()
        answer: list[httpx.Response] = []

        def post_json() -> None:
            answer.append(httpx.post(srv.base_url + "/v1/completions", timeout=60,
                                     headers={"Authorization": f"Bearer {key}"},
                                     json={"model": model, "prompt": "go", "max_tokens": LONG, "ignore_eos": True}))

        poster = threading.Thread(target=post_json)
        poster.start()
        assert started.wait(60) and not errors, errors
        time.sleep(0.3)  # the JSON request is admitted too
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        poster.join(30)
        streamer.join(30)
        assert not poster.is_alive() and not streamer.is_alive()
        rc = srv.proc.wait(30)
        took = time.monotonic() - t0
    finally:
        if srv.alive:
            srv.proc.kill()
    assert not errors, errors
    assert rc == 0, srv.log_text()[-3000:]
    assert took < 15, f"the server took {took:.1f} s to stop with a 1 s drain timeout"

    r = answer[0]
    assert r.status_code == 503, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert err["code"] == "draining" and "drain timeout" in err["message"]
    assert r.headers["retry-after"]

    # the stream got tokens, then an error event, and no [DONE]
    tokens = [e for e in events if e.get("choices")]
    assert tokens and "error" in events[-1] and events[-1]["error"]["code"] == "draining", events[-3:]
    assert not any(e.get("done") for e in events)

    with sqlite3.connect(tmp_path / "data" / "loraplex.db") as db:
        rows = db.execute("SELECT endpoint, completion_tokens, status FROM usage_records").fetchall()
    assert len(rows) == 2, rows
    assert {status for _, _, status in rows} == {"error"}
    completion = sorted(c for _, c, _ in rows)
    assert completion[0] == 0  # the JSON request: its client got only the 503
    assert len(tokens) <= completion[1] < LONG  # the stream: what it was sent before the error event


def test_a_second_ctrl_c_quits_at_once_and_stops_the_engine_process(tmp_path, tiny_model):
    srv = start_server(tmp_path / "data", demo_model_from=tiny_model["model_dir"],
                       env={"LORAPLEX_DRAIN_TIMEOUT_S": "300"})
    try:
        key = srv.create_tenant("impatient")["key"]
        model = srv.client(key).get("/v1/models").json()["data"][0]["id"]
        engine_pids = {p for p in _children(srv.proc.pid) if _alive(p)}
        assert engine_pids, "no engine process found"
        events: list[dict] = []
        started, errors = threading.Event(), []
        streamer = threading.Thread(target=_stream_until_first_token,
                                    args=(srv, key, model, events, started, errors), daemon=True)
        streamer.start()
        assert started.wait(60) and not errors, errors
        srv.proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        assert srv.alive  # the first Ctrl-C drains (for up to 300 s here)
        srv.proc.send_signal(signal.SIGINT)
        t0 = time.monotonic()
        try:
            srv.proc.wait(20)
        except Exception:  # noqa: BLE001
            raise AssertionError("the server did not exit within 20 s of a second Ctrl-C:\n"
                                 + srv.log_text()[-3000:]) from None
        took = time.monotonic() - t0
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in engine_pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [p for p in engine_pids if _alive(p)]
    finally:
        if srv.alive:
            srv.proc.kill()
    assert not left, f"engine process(es) {left} still running after the server exited"
    assert took < 20


def test_a_json_request_cut_by_an_engine_death_bills_no_completion_tokens(tmp_path, tiny_model):
    """Its client gets a 503 and none of the tokens; docs/usage-billing.md: completion_tokens is what the client
    received. (A stream so cut is billed what it was sent: test_usage_* cover streams.)"""
    srv = start_server(tmp_path / "data", demo_model_from=tiny_model["model_dir"])
    try:
        key = srv.create_tenant("unlucky")["key"]
        model = srv.client(key).get("/v1/models").json()["data"][0]["id"]
        engine_pids = {p for p in _children(srv.proc.pid) if _alive(p)}
        answer: list[httpx.Response] = []
        poster = threading.Thread(target=lambda: answer.append(httpx.post(
            srv.base_url + "/v1/completions", timeout=60, headers={"Authorization": f"Bearer {key}"},
            json={"model": model, "prompt": "go", "max_tokens": LONG, "ignore_eos": True})))
        poster.start()
        deadline = time.monotonic() + 30
        while _running(srv) == 0:
            assert time.monotonic() < deadline, "the request never started running"
            time.sleep(0.05)
        time.sleep(0.5)  # some hundreds of tokens generated
        for pid in engine_pids:
            os.kill(pid, signal.SIGKILL)
        poster.join(30)
        assert answer and answer[0].status_code == 503, answer and answer[0].text
        assert answer[0].json()["error"]["code"] == "engine_error"
        srv.wait_none_in_flight()
    finally:
        rc = srv.stop()
    assert rc == 0, srv.log_text()[-3000:]
    with sqlite3.connect(tmp_path / "data" / "loraplex.db") as db:
        rows = db.execute("SELECT prompt_tokens, completion_tokens, status FROM usage_records").fetchall()
    assert rows == [(rows[0][0], 0, "error")], rows


def test_requests_waiting_on_a_stuck_engine_end_at_the_drain_timeout_and_the_server_stops(tmp_path, tiny_model):
    """An engine that stopped answering (SIGSTOP here) before it admitted the requests: the drain timeout still
    ends them with a 503 draining (they used to wait for the engine, then for uvicorn's cancel: a bare 500), and
    closing the silent engine takes seconds, not the full close timeout."""
    srv = start_server(tmp_path / "data", demo_model_from=tiny_model["model_dir"],
                       env={"LORAPLEX_DRAIN_TIMEOUT_S": "2"})
    engine_pid = None
    try:
        key = srv.create_tenant("stuck")["key"]
        model = srv.client(key).get("/v1/models").json()["data"][0]["id"]
        (engine_pid,) = {p for p in _children(srv.proc.pid) if _alive(p) and b"spawn_main" in _cmdline(p)}
        os.kill(engine_pid, signal.SIGSTOP)
        answers: list[httpx.Response] = []

        def post(stream: bool) -> None:
            answers.append(httpx.post(srv.base_url + "/v1/completions", timeout=90,
                                      headers={"Authorization": f"Bearer {key}"},
                                      json={"model": model, "prompt": "go", "max_tokens": 8, "stream": stream}))

        posters = [threading.Thread(target=post, args=(stream,)) for stream in (False, True)]
        for p in posters:
            p.start()
        time.sleep(6)  # the engine has been silent past STALLED_CLOSE_S: its close does not wait 30 s
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        for p in posters:
            p.join(60)
        answered = time.monotonic() - t0
        rc = srv.proc.wait(60)
        took = time.monotonic() - t0
    finally:
        if srv.alive:
            srv.proc.kill()
        if engine_pid is not None and _alive(engine_pid):
            os.kill(engine_pid, signal.SIGKILL)
    assert rc == 0, srv.log_text()[-3000:]
    assert answered < 2 + 5, f"the waiting requests were answered {answered:.1f} s after SIGTERM"
    assert took < 2 + 5 + 10, f"the server took {took:.1f} s to stop"
    assert len(answers) == 2
    for r in answers:
        assert r.status_code == 503 and r.json()["error"]["code"] == "draining", r.text
    assert not _alive(engine_pid)
    with sqlite3.connect(tmp_path / "data" / "loraplex.db") as db:
        rows = db.execute("SELECT completion_tokens, status FROM usage_records").fetchall()
    assert all(status == "error" and tokens == 0 for tokens, status in rows), rows
