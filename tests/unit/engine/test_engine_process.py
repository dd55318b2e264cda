"""ProcessEngine: the engine's loop in a child process; the same contract as AsyncEngine over a pipe, and a child
that dies (or a server that dies) never leaves anything hanging."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.engine.config import EngineConfig
from loraplex.engine.engine_process import HEARTBEAT_S, ProcessEngine
from loraplex.engine.protocol import EngineDeadError, EngineRequest
from loraplex.engine.sampling_params import RequestLimitError, SamplingParamsError
from tests.unit.engine.test_async_engine import _long_stream_started

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def engine(tiny_model):
    eng = ProcessEngine.from_config(EngineConfig(model=tiny_model["model_dir"], dtype="float32", enable_lora=True,
                                                 max_loras=2))
    yield eng
    eng.close()


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


async def _collect(eng, req):
    return [d async for d in eng.generate(req)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by its parent) counts as gone
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(")")[-1].split()[0] == "Z")


async def test_streams_match_the_offline_api_with_and_without_adapters(engine, tiny_model):
    assert engine.pid != os.getpid() and engine.is_healthy()
    assert engine.model_id == Path(tiny_model["model_dir"]).name
    assert engine.vocab_size > 0 and engine.max_model_len > 0
    adapter = tiny_model["adapters"][1]["name"]
    lora = LoRARequest(adapter, 1, str(Path(tiny_model["model_dir"]) / "adapters" / adapter))
    prompt = engine.apply_chat_template([{"role": "user", "content": "Hello there"}])
    reqs = [EngineRequest(f"r{i}", prompt[: 5 + i * 3], _greedy(10), lora_request=lora if i % 2 else None)
            for i in range(4)]
    streams = await asyncio.gather(*(_collect(engine, r) for r in reqs))
    offline = LLM(tiny_model["model_dir"], dtype="float32", enable_lora=True, max_loras=2).generate(
        [{"prompt_token_ids": r.prompt_token_ids} for r in reqs], _greedy(10),
        lora_request=[r.lora_request for r in reqs])
    for deltas, want in zip(streams, offline):
        assert sum((d.token_ids for d in deltas), []) == want.outputs[0].token_ids
        assert "".join(d.text for d in deltas) == want.outputs[0].text
        assert deltas[-1].finished and deltas[-1].finish_reason == "length"
        assert not any(d.finished for d in deltas[:-1])
    # the with-adapter rows really ran the adapter: its tokens differ from the base model's on the same prompt
    base = await _collect(engine, EngineRequest("base-r1", reqs[1].prompt_token_ids, _greedy(10)))
    assert sum((d.token_ids for d in base), []) != sum((d.token_ids for d in streams[1]), [])
    stats = engine.stats()  # the child's loop counters come back with each step
    assert stats.loop_steps > 0 and stats.loop_step_seconds > 0 and stats.num_running == 0


async def test_n_samples_stream_until_all_finish(engine):
    params = SamplingParams(n=3, max_tokens=5, temperature=1.0, seed=1, ignore_eos=True)
    deltas = await _collect(engine, EngineRequest("multi", [1, 50, 60, 70], params))
    assert sorted(d.index for d in deltas if d.finished) == [0, 1, 2]


async def test_a_refusal_crosses_the_pipe_with_its_field_and_limit_and_keeps_nothing(engine):
    ok = EngineRequest("ok", [1, 40, 41, 42], SamplingParams(max_tokens=2))
    for bad, param, limit in ((EngineRequest("many", [1, 2], SamplingParams(n=300)), "n", 256),
                              (EngineRequest("huge", [5] * 5000, SamplingParams()), "prompt",
                               engine.max_model_len - 1)):
        with pytest.raises(RequestLimitError) as err:
            await engine.add_requests([ok, bad])
        assert (err.value.param, err.value.limit) == (param, limit), err.value
    with pytest.raises(ValueError, match="token ids"):
        await engine.add_requests([EngineRequest("vocab", [engine.vocab_size + 5], SamplingParams())])
    params = SamplingParams(max_tokens=2)
    params.temperature = -1.0
    with pytest.raises(SamplingParamsError, match="^temperature: "):
        await engine.add_requests([EngineRequest("temp", [1, 2], params)])
    (stream,) = await engine.add_requests([EngineRequest("ok", [1, 60, 61], SamplingParams(max_tokens=2))])
    assert sum([len(d.token_ids) async for d in stream]) == 2  # "ok" was taken back: its id is free again
    assert engine.is_healthy()


async def test_request_id_in_use_is_refused_without_touching_the_first_stream(engine):
    first = asyncio.create_task(_collect(engine, EngineRequest("dup", [1, 40, 41], _greedy(30))))
    while "dup" not in engine._streams:
        await asyncio.sleep(0.01)
    with pytest.raises(ValueError, match="already in use"):
        await _collect(engine, EngineRequest("dup", [1, 50], SamplingParams(max_tokens=2)))
    deltas = await asyncio.wait_for(first, 30)
    assert deltas[-1].finished and sum(len(d.token_ids) for d in deltas) == 30


async def test_abort_and_early_exit_end_the_stream_and_the_stats_follow(engine):
    task, got = await _long_stream_started(engine, "long")
    await engine.abort("long")
    await asyncio.wait_for(task, 30)
    assert got[-1].finished and got[-1].finish_reason == "abort"
    stream = engine.generate(EngineRequest("left", [1, 40, 41], _greedy(2000)))
    await stream.__anext__()
    await stream.aclose()  # leaving early aborts it in the child
    for _ in range(500):
        if engine.stats().num_running == 0 and engine.stats().num_waiting == 0:
            break
        await asyncio.sleep(0.01)
    assert engine.stats().num_running == 0 and engine.stats().num_waiting == 0


async def test_sigint_and_sigterm_to_the_engine_process_leave_it_serving(engine):
    """A Ctrl-C or a stop of the whole process group reaches the engine too: it keeps serving while the server drains
    (the server stops it when done)."""
    task = asyncio.create_task(_collect(engine, EngineRequest("signals", [1, 40, 41], _greedy(40))))
    await asyncio.sleep(0.05)
    os.kill(engine.pid, signal.SIGINT)
    os.kill(engine.pid, signal.SIGTERM)
    deltas = await asyncio.wait_for(task, 30)
    assert deltas[-1].finish_reason == "length" and sum(len(d.token_ids) for d in deltas) == 40
    assert engine.is_healthy()


async def test_a_killed_engine_process_ends_open_streams_and_refuses_new_requests(tiny_model):
    eng = ProcessEngine.from_config(EngineConfig(model=tiny_model["model_dir"], dtype="float32"))
    try:
        task, got = await _long_stream_started(eng, "victim", max_tokens=1000, per_delta_s=0.01)
        os.kill(eng.pid, signal.SIGKILL)
        await asyncio.wait_for(task, 30)
        assert got[-1].finished and got[-1].finish_reason == "error" and "killed by SIGKILL" in got[-1].error
        assert not eng.is_healthy()
        with pytest.raises(EngineDeadError):
            await _collect(eng, EngineRequest("after", [1, 2], SamplingParams()))
    finally:
        eng.close(timeout_s=5)


async def test_an_idle_engine_beats_and_a_stopped_one_falls_silent_then_is_killed_with_the_reason(tiny_model):
    eng = ProcessEngine.from_config(EngineConfig(model=tiny_model["model_dir"], dtype="float32"))
    try:
        await asyncio.sleep(3 * HEARTBEAT_S)  # idle: the child's heartbeat keeps the silence under a beat or two
        assert eng.is_healthy() and eng.silent_s() < 2.5 * HEARTBEAT_S
        task, got = await _long_stream_started(eng, "frozen", max_tokens=1000, per_delta_s=0.01)
        os.kill(eng.pid, signal.SIGSTOP)  # as a hung device or a deadlock looks from here: alive, not answering
        await asyncio.sleep(3 * HEARTBEAT_S)
        assert eng.is_healthy() and eng.silent_s() >= 2.5 * HEARTBEAT_S and not task.done()
        eng.kill("the engine stopped answering for 3 s")
        await asyncio.wait_for(task, 30)
        assert got[-1].finish_reason == "error" and "stopped answering for 3 s" in got[-1].error
        assert not eng.is_healthy() and eng.silent_s() == 0.0
    finally:
        eng.close(timeout_s=5)


async def test_closing_a_stuck_engine_waits_the_short_stall_timeout_not_the_full_one(tiny_model):
    stalled_close_s = 1.0  # (the server's is STALLED_CLOSE_S)
    eng = ProcessEngine.from_config(EngineConfig(model=tiny_model["model_dir"], dtype="float32"),
                                    stalled_close_s=stalled_close_s)
    os.kill(eng.pid, signal.SIGSTOP)
    await asyncio.sleep(stalled_close_s + 2 * HEARTBEAT_S)
    started = time.monotonic()
    await asyncio.to_thread(eng.close, 60.0)
    assert time.monotonic() - started < stalled_close_s + 10  # stopped and killed, not 60 s of waiting
    assert not _alive(eng.pid)


async def test_shutdown_ends_open_streams_and_stops_the_process(tiny_model):
    eng = ProcessEngine.from_config(EngineConfig(model=tiny_model["model_dir"], dtype="float32"))
    task, got = await _long_stream_started(eng, "open")
    await eng.shutdown()
    await asyncio.wait_for(task, 30)
    assert got[-1].finished and got[-1].finish_reason == "error" and "shut down" in got[-1].error
    assert not eng.is_healthy() and not _alive(eng.pid)
    with pytest.raises(EngineDeadError):
        await eng.add_requests([EngineRequest("late", [1, 2], SamplingParams())])


def test_a_model_that_fails_to_load_raises_the_childs_error(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    t0 = time.monotonic()
    with pytest.raises(Exception) as err:
        ProcessEngine.from_config(EngineConfig(model=str(tmp_path), dtype="float32"))
    assert not isinstance(err.value, TimeoutError) and time.monotonic() - t0 < 120
    assert "json" in f"{type(err.value).__name__} {err.value}".lower(), err.value


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_engine_process_exits_when_the_server_dies(tiny_model, tmp_path):
    script = textwrap.dedent(f"""
        import os
        from loraplex.engine.config import EngineConfig
        from loraplex.engine.engine_process import HEARTBEAT_S, STALLED_CLOSE_S, ProcessEngine
        if __name__ == "__main__":
            eng = ProcessEngine.from_config(EngineConfig(model={tiny_model["model_dir"]!r}, dtype="float32"))
            print(eng.pid, flush=True)
            os._exit(0)  # no close(): as if the server were killed
    """)
    path = tmp_path / "server.py"
    path.write_text(script)
    out = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    child = int(out.stdout.split()[-1])
    deadline = time.monotonic() + 30
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child), "the engine process outlived the server that started it"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_server_that_exits_without_closing_the_engine_stops_it_at_exit(tiny_model, tmp_path):
    """A second Ctrl-C skips the app's shutdown: the interpreter then exits with the engine never told to stop, and
    multiprocessing's exit handler waited forever for a child that waited for the pipe to close."""
    script = textwrap.dedent(f"""
        from loraplex.engine.config import EngineConfig
        from loraplex.engine.engine_process import HEARTBEAT_S, STALLED_CLOSE_S, ProcessEngine
        if __name__ == "__main__":
            eng = ProcessEngine.from_config(EngineConfig(model={tiny_model["model_dir"]!r}, dtype="float32"))
            print(eng.pid, flush=True)
            # returns: the interpreter's normal exit, no close()
    """)
    path = tmp_path / "server.py"
    path.write_text(script)
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert time.monotonic() - t0 < 90
    assert "stopping it now" in out.stderr
    assert not _alive(int(out.stdout.split()[-1]))
