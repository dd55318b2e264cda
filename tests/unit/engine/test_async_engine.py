"""AsyncEngine: streaming deltas from the loop thread, aborts, and a dead loop that never hangs a caller."""

from __future__ import annotations

import asyncio
import sys
import threading
from pathlib import Path

import pytest

from loraplex import LLM, SamplingParams
from loraplex.engine.async_engine import LOOP_THREAD_OS_NAME, AsyncEngine
from loraplex.engine.config import EngineConfig
from loraplex.engine.engine_core import LLMEngine
from loraplex.engine.protocol import EngineDeadError, EngineRequest
from loraplex.engine.sampling_params import RequestLimitError, SamplingParamsError


@pytest.fixture
async def engine(tiny_model):
    eng = AsyncEngine.from_config(EngineConfig(model=tiny_model["model_dir"], dtype="float32"))
    yield eng
    await eng.shutdown()


async def _collect(eng, req):
    return [d async for d in eng.generate(req)]


async def _long_stream_started(eng, request_id: str, max_tokens: int = 2000, per_delta_s: float = 0.0):
    """A long greedy request consumed by a background task (``per_delta_s``: a reader slower than the engine, so
    deltas queue up and the stream stays open); returns once its first delta arrived."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    got = []

    async def consume():
        async for d in eng.generate(EngineRequest(request_id, [1, 40, 41], params)):
            got.append(d)
            if per_delta_s:
                await asyncio.sleep(per_delta_s)

    task = asyncio.create_task(consume())
    while not got:
        await asyncio.sleep(0.01)
    return task, got


async def test_streams_match_offline_api(engine, tiny_model):
    assert engine.model_id == tiny_model["model_dir"].rstrip("/").split("/")[-1]
    prompt = engine.apply_chat_template([{"role": "user", "content": "Hello there"}])
    assert prompt == engine.encode("<|user|>Hello there<|end|><|assistant|>", add_special_tokens=True)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    reqs = [EngineRequest(f"r{i}", prompt[: 5 + i * 3], params) for i in range(3)]
    streams = await asyncio.gather(*(_collect(engine, r) for r in reqs))
    offline = LLM(tiny_model["model_dir"], dtype="float32").generate(
        [{"prompt_token_ids": r.prompt_token_ids} for r in reqs], params)
    for deltas, want in zip(streams, offline):
        assert sum((d.token_ids for d in deltas), []) == want.outputs[0].token_ids
        assert "".join(d.text for d in deltas) == want.outputs[0].text
        final = deltas[-1]
        assert final.finished and final.finish_reason == "length" and final.num_generated_tokens == 12
        assert deltas[0].first_token_time is not None and final.finished_time is not None
        assert not any(d.finished for d in deltas[:-1])
    assert engine.is_healthy() and engine.stats().num_running == 0


async def test_n_samples_stream_until_all_finish(engine):
    params = SamplingParams(n=3, max_tokens=5, temperature=1.0, seed=1, ignore_eos=True)
    deltas = await _collect(engine, EngineRequest("multi", [1, 50, 60, 70], params))
    assert sorted(d.index for d in deltas if d.finished) == [0, 1, 2]


async def test_abort_and_early_exit_end_the_stream(engine):
    task, got = await _long_stream_started(engine, "long")
    await engine.abort("long")
    await asyncio.wait_for(task, 10)
    assert got[-1].finished and got[-1].finish_reason == "abort"
    # leaving the iterator early aborts too: the engine drains
    params = SamplingParams(max_tokens=2000, temperature=0, ignore_eos=True)
    stream = engine.generate(EngineRequest("left", [1, 40, 41], params))
    await stream.__anext__()
    await stream.aclose()
    for _ in range(200):
        if engine.stats().num_running == 0 and not engine.engine.has_unfinished_requests():
            break
        await asyncio.sleep(0.01)
    assert not engine.engine.has_unfinished_requests()
    # the idle engine's stats follow the abort too (no step runs after it to refresh them)
    assert engine.stats().num_running == 0 and engine.stats().num_waiting == 0


async def test_bad_request_raises_before_streaming(engine):
    with pytest.raises(ValueError, match="max_model_len"):
        await _collect(engine, EngineRequest("huge", [5] * 5000, SamplingParams()))
    assert engine.is_healthy()


async def test_dead_loop_fails_open_streams_and_new_requests(engine):
    task, got = await _long_stream_started(engine, "victim")

    def boom(out, prev=None):
        raise RuntimeError("device fell over")

    engine.engine.runner.launch = boom
    await asyncio.wait_for(task, 10)
    assert got[-1].finished and got[-1].finish_reason == "error" and "device fell over" in got[-1].error
    assert not engine.is_healthy()
    with pytest.raises(EngineDeadError):
        await _collect(engine, EngineRequest("after", [1, 2], SamplingParams()))


async def test_request_id_in_use_is_refused_without_touching_the_first_stream(engine):
    first = asyncio.create_task(_collect(engine, EngineRequest(
        "dup", [1, 40, 41], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))))
    while "dup" not in engine._streams:
        await asyncio.sleep(0.01)
    with pytest.raises(ValueError, match="already in use"):
        await _collect(engine, EngineRequest("dup", [1, 50], SamplingParams(max_tokens=2)))
    deltas = await asyncio.wait_for(first, 10)  # hung forever: the refused request dropped its stream
    assert deltas[-1].finished and sum(len(d.token_ids) for d in deltas) == 30


async def test_add_requests_refuses_before_any_stream_naming_the_field(engine):
    # a refusal comes from the admission step itself (what the HTTP route awaits before answering),
    # names the field and the limit, and takes back the whole group: "ok" is never computed
    ok = EngineRequest("ok", [1, 40, 41, 42], SamplingParams(max_tokens=2))
    for bad, param, limit in ((EngineRequest("many", [1, 2], SamplingParams(n=300)), "n", 256),
                              (EngineRequest("huge", [5] * 5000, SamplingParams()), "prompt",
                               engine.max_model_len - 1)):
        with pytest.raises(RequestLimitError) as err:
            await engine.add_requests([ok, bad])
        assert (err.value.param, err.value.limit) == (param, limit), err.value
    computed = engine.engine.counters["num_computed_prompt_tokens"]
    (stream,) = await engine.add_requests([EngineRequest("ok", [1, 60, 61], SamplingParams(max_tokens=2))])
    assert sum([len(d.token_ids) async for d in stream]) == 2  # "ok" is free again: nothing kept it
    assert engine.engine.counters["num_computed_prompt_tokens"] - computed == 3
    assert not engine.engine.has_unfinished_requests() and engine.is_healthy()


async def test_a_caller_cancelled_while_its_request_waits_for_admission_leaves_the_loop_alive(engine):
    # the loop is held inside a step, so the add waits in the queue while its caller is cancelled
    gate, in_step = threading.Event(), threading.Event()
    step = engine.engine.step

    def gated_step():
        in_step.set()
        gate.wait(10)
        return step()

    task, _ = await _long_stream_started(engine, "busy")
    # gated only now: gated from the start, each of the stream's first steps waited out the gate's 10 s
    engine.engine.step = gated_step  # the loop's next step holds
    await asyncio.to_thread(in_step.wait, 10)
    waiting = asyncio.create_task(engine.generate(EngineRequest("gone", [1, 2, 3], SamplingParams())).__anext__())
    await asyncio.sleep(0.05)
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    await asyncio.sleep(0)
    engine.engine.step = step
    gate.set()
    await engine.abort("busy")
    await asyncio.wait_for(task, 10)
    # the loop died on set_result() of the cancelled future; and nobody could abort a request added for it
    after = await _collect(engine, EngineRequest("after", [1, 2], SamplingParams(max_tokens=1)))
    assert after[-1].finished and engine.is_healthy()
    assert "gone" not in engine._streams and not engine.engine.has_unfinished_requests()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_an_aborted_request_reports_the_prompt_tokens_the_engine_ran(tiny_model, async_scheduling):
    """What metering bills an aborted request for its prompt: nothing while it waited for admission, the
    chunks that ran of a chunked prefill, the whole prompt once the prompt was done."""
    engine = LLMEngine(EngineConfig(model=tiny_model["model_dir"], dtype="float32", max_num_seqs=1,
                                    max_num_batched_tokens=16, async_scheduling=async_scheduling))
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    prompt = [1, *range(40, 79)]  # 40 tokens: prefill chunks of 16, 16 and 8
    engine.add_request("runs", prompt, params)
    engine.add_request("waits", [1, 50, 51], params)  # max_num_seqs=1: not admitted while "runs" runs
    finals = {}

    def run(steps: int | None = None) -> None:
        while engine.has_unfinished_requests() and steps != 0:
            finals.update({d.request_id: d for d in engine.step() if d.finished})
            steps = None if steps is None else steps - 1

    run(steps=1)
    engine.abort_request("waits")
    engine.abort_request("runs")
    run()
    assert finals["waits"].finish_reason == "abort" and finals["waits"].num_computed_prompt_tokens == 0
    assert finals["runs"].finish_reason == "abort" and finals["runs"].num_computed_prompt_tokens == 16
    assert finals["runs"].num_prompt_tokens == 40
    engine.add_request("whole", [1, *range(100, 139)], params)
    run()
    assert finals["whole"].finish_reason == "length" and finals["whole"].num_computed_prompt_tokens == 40


async def test_a_closed_stream_still_delivers_the_abort_report(tiny_model):
    """After ``close()`` the caller can read the abort's final delta (how much of the prompt ran)."""
    engine = AsyncEngine.from_config(EngineConfig(model=tiny_model["model_dir"], dtype="float32", max_num_seqs=1))
    try:
        task, _ = await _long_stream_started(engine, "busy")
        (queued,) = await engine.add_requests([EngineRequest("queued", [1, 50, 51], SamplingParams(max_tokens=4))])
        queued.close()
        finals = await queued.drain(10)
        assert [d.finish_reason for d in finals] == ["abort"] and finals[0].num_computed_prompt_tokens == 0
        assert await queued.drain(10) == []  # done: nothing more comes
        await engine.abort("busy")
        await asyncio.wait_for(task, 10)
    finally:
        await engine.shutdown()


@pytest.mark.parametrize("loop_threads, expected", [(1, 1), (0, 2), (None, 1)])
async def test_loop_thread_sets_torch_intra_op_threads(tiny_model, loop_threads, expected):
    """The loop thread runs torch with ``loop_torch_threads`` intra-op threads (0: whatever the process had; unset:
    1 on the CPU): on a 2-core CPU the same generate ran 4.5x slower in a non-main thread with 2 of them than 1."""
    import torch

    torch.set_num_threads(2)  # the loop thread starts from the process default; with 0 it keeps it
    eng = AsyncEngine.from_config(EngineConfig(model=tiny_model["model_dir"], dtype="float32",
                                               loop_torch_threads=loop_threads))
    try:
        params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
        deltas = await _collect(eng, EngineRequest("t", [1, 40, 41], params))
        assert sum(len(d.token_ids) for d in deltas) == 3
        assert eng.loop_torch_threads == expected  # as seen inside the loop thread (OpenMP's setting is per thread)
    finally:
        await eng.shutdown()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread names are read from /proc")
async def test_the_loop_thread_has_an_os_level_name(engine):
    comm = Path(f"/proc/self/task/{engine._thread.native_id}/comm")
    for _ in range(100):  # the thread names itself first thing
        if comm.read_text().strip() == LOOP_THREAD_OS_NAME:
            break
        await asyncio.sleep(0.01)
    assert comm.read_text().strip() == LOOP_THREAD_OS_NAME


async def test_a_sampling_params_changed_between_requests_samples_with_its_new_values(engine):
    """The server, or a client of the engine, may reuse one SamplingParams: each request runs it as it was when
    the request was added (the sampler's flags and bias arrays were cached on it at its first use)."""
    def tokens(deltas):
        return [t for d in deltas for t in d.token_ids]

    prompt = [1, 40, 41]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    greedy = tokens(await _collect(engine, EngineRequest("g", prompt, params)))
    params.temperature, params.seed = 1.0, 5
    sampled = tokens(await _collect(engine, EngineRequest("s", prompt, params)))
    fresh = SamplingParams(max_tokens=6, temperature=1.0, seed=5, ignore_eos=True)
    assert sampled == tokens(await _collect(engine, EngineRequest("f", prompt, fresh))) != greedy
    params.logit_bias = {5: 100.0}
    (stream,) = await engine.add_requests([EngineRequest("b", prompt, params)])
    params.logit_bias = {6: 100.0}  # after the call: that request keeps what it was added with
    assert tokens([d async for d in stream]) == [5] * 6
    params.temperature = -1.0
    with pytest.raises(SamplingParamsError, match="^temperature: "):
        await engine.add_requests([EngineRequest("bad", prompt, params)])
    assert engine.is_healthy() and not engine.engine.has_unfinished_requests()
