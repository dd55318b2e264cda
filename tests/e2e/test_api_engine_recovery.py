"""A replica recovers by itself when its engine loop dies: the request in flight ends with an error, /ready
turns 503, the supervisor loads a fresh engine, and the same server answers again (SECURITY.md item 21). The loop
runs in a thread of the server (a step that raises) or in a process of its own (killed with SIGKILL, as the
kernel's OOM killer would)."""

from __future__ import annotations

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


@pytest.fixture(scope="module", params=["thread", "process"])
def live(tmp_path_factory, tiny_model, request):
    import uvicorn

    settings = Settings(data_dir=str(tmp_path_factory.mktemp("recovery")), device="cpu", num_kv_blocks=256,
                        model=tiny_model["model_dir"], engine_restart_delay_s=0.2,
                        engine_process=request.param == "process")
    keys: list[str] = []
    app = create_app(settings, on_bootstrap_key=keys.append)  # the platform owns (and supervises) the engine
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while not keys or httpx.get(base + "/ready").status_code != 200:
        assert time.monotonic() < deadline, "the server never became ready"
        time.sleep(0.1)
    yield {"base": base, "key": keys[0], "app": app}
    server.should_exit = True
    thread.join(30)


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
