"""A replica recovers by itself when its engine loop dies: the request in flight ends with an error, /ready
turns 503, the supervisor loads a fresh engine, and the same server answers again (SECURITY.md item 21). The loop
runs in a thread of the server (a step that raises) or in a process of its own (killed with SIGKILL, as the
kernel's OOM killer would)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import httpx
import openai
import pytest

from loraplex.platform.app import create_app
from loraplex.settings import Settings
from tests.e2e.server import free_port


@contextlib.contextmanager
def _serving(settings: Settings):
    """An app on its own port in a thread (the platform owns and supervises the engine), once /ready says 200."""
    import uvicorn

    keys: list[str] = []
    app = create_app(settings, on_bootstrap_key=keys.append)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while not keys or httpx.get(base + "/ready").status_code != 200:
        assert time.monotonic() < deadline, "the server never became ready"
        time.sleep(0.1)
    try:
        yield {"base": base, "key": keys[0], "app": app}
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.fixture(scope="module", params=["thread", "process"])
def live(tmp_path_factory, tiny_model, request):
    settings = Settings(data_dir=str(tmp_path_factory.mktemp("recovery")), device="cpu", num_kv_blocks=256,
                        model=tiny_model["model_dir"], engine_restart_delay_s=0.2,
                        engine_process=request.param == "process")
    with _serving(settings) as served:
        yield served


def test_dead_engine_is_replaced_and_serving_resumes(live):
    services = live["app"].state.services
    first = services.engine
    client = openai.OpenAI(api_key=live["key"], base_url=live["base"] + "/v1", max_retries=0, timeout=30)
    model = client.models.list().data[0].id
    before = client.completions.create(model=model, prompt="The river", max_tokens=4, temperature=0)

    if hasattr(first, "pid"):  # ProcessEngine
        assert first.pid != os.getpid()
        os.kill(first.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while first.is_healthy():
            assert time.monotonic() < deadline, "the server did not notice its engine process die"
            time.sleep(0.01)
    else:
        def broken_step():
            raise RuntimeError("simulated device fault")

        first.engine.step = broken_step  # the loop thread dies on its next step
        with pytest.raises(openai.APIError):
            client.completions.create(model=model, prompt="The river", max_tokens=4, temperature=0)
    assert not first.is_healthy()

    deadline = time.monotonic() + 60
    while services.engine is None or services.engine is first or not services.engine.is_healthy():
        assert time.monotonic() < deadline, "no new engine within 60 s"
        time.sleep(0.05)
    assert services.engine_restarts == 1
    assert httpx.get(live["base"] + "/ready").status_code == 200
    after = client.completions.create(model=model, prompt="The river", max_tokens=4, temperature=0)
    assert after.choices[0].text == before.choices[0].text  # same weights, same greedy tokens


STALL_S = 8.0


@pytest.fixture
def stalling(tmp_path, tiny_model):
    settings = Settings(data_dir=str(tmp_path), device="cpu", num_kv_blocks=256, model=tiny_model["model_dir"],
                        engine_restart_delay_s=0.2, engine_process=True, engine_stall_timeout_s=STALL_S)
    with _serving(settings) as served:
        yield served
        engine = served["app"].state.services.engine
        if engine is not None and engine.is_healthy():  # a test that failed early leaves it stopped
            os.kill(engine.pid, signal.SIGCONT)


def test_a_stuck_engine_process_leaves_rotation_then_is_killed_and_replaced(stalling):
    """An engine process that stops answering (a hung device, a deadlock: here SIGSTOP) is alive but silent: /ready
    turns 503 engine_stalled after a quarter of the stall timeout, the request waiting on it fails at the timeout
    instead of hanging, and the supervisor kills the child and loads a new one that serves again."""
    services = stalling["app"].state.services
    first = services.engine
    client = openai.OpenAI(api_key=stalling["key"], base_url=stalling["base"] + "/v1", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    before = client.completions.create(model=model, prompt="The river", max_tokens=4, temperature=0)

    os.kill(first.pid, signal.SIGSTOP)
    stopped = time.monotonic()
    outcome: dict = {}

    def call() -> None:
        try:
            client.completions.create(model=model, prompt="The river", max_tokens=4, temperature=0)
        except openai.APIError as exc:
            outcome["error"] = exc
        outcome["at"] = time.monotonic() - stopped

    caller = threading.Thread(target=call)
    caller.start()
    deadline = stopped + STALL_S
    while (ready := httpx.get(stalling["base"] + "/ready")).status_code == 200:
        assert time.monotonic() < deadline, "/ready stayed 200 while the engine answered nothing"
        time.sleep(0.1)
    assert ready.status_code == 503 and ready.json()["status"] == "engine_stalled", ready.text
    assert time.monotonic() - stopped >= STALL_S / 4 - 1.5  # a quarter of the timeout, less the beat it missed
    caller.join(STALL_S + 30)
    assert "error" in outcome and STALL_S - 1.5 <= outcome["at"] < STALL_S + 10, outcome
    assert "stopped answering" in str(outcome["error"]), outcome["error"]

    deadline = time.monotonic() + 60
    while services.engine is None or services.engine is first or not services.engine.is_healthy():
        assert time.monotonic() < deadline, "no new engine within 60 s"
        time.sleep(0.05)
    assert services.engine_restarts == 1 and not first.is_healthy()
    assert httpx.get(stalling["base"] + "/ready").status_code == 200
    after = client.completions.create(model=model, prompt="The river", max_tokens=4, temperature=0)
    assert after.choices[0].text == before.choices[0].text
