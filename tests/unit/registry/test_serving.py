"""Upload, then call: the new adapter answers a chat completion within a second, with the same tokens the
offline engine gives for the same adapter files; a delete evicts it from the engine."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.config import EngineConfig
from loraplex.engine.lora_request import LoRARequest
from loraplex.engine.sampling_params import SamplingParams
from tests.conftest import adapter_dir
from tests.unit.registry.conftest import adapter_files, registry_app

MESSAGES = [{"role": "user", "content": "Tell me about the river and the old mill."}]
MAX_TOKENS = 8


def _engine_config(model_dir: str) -> EngineConfig:
    return EngineConfig(model=model_dir, dtype="float32", enable_lora=True, max_loras=4, max_lora_rank=64,
                        num_kv_blocks=128, max_model_len=512)


@pytest.fixture
async def engine(tiny_model):
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the suite shares two cores; oversubscription only adds noise
    eng = AsyncEngine.from_config(_engine_config(tiny_model["model_dir"]))
    yield eng
    await eng.shutdown()
    torch.set_num_threads(threads)


def _offline_text(tiny_model, prompt_ids: list[int], index: int) -> tuple[str, list[int]]:
    from loraplex.engine.llm import LLM

    # the offline API on its own engine, reading the adapter files where the demo generator wrote them
    llm = LLM(tiny_model["model_dir"], enable_lora=True, max_lora_rank=64, dtype="float32", num_kv_blocks=128,
              max_model_len=512)
    out = llm.generate({"prompt_token_ids": prompt_ids}, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
                       lora_request=LoRARequest("offline", 7, adapter_dir(tiny_model, index)))
    return out[0].outputs[0].text, list(out[0].outputs[0].token_ids)


async def _chat(rapp, key, model: str):
    return await rapp.client.post("/v1/chat/completions", headers=rapp.headers(key), json={
        "model": model, "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0})


async def _stream_chat(rapp, key, model: str) -> tuple[float, str]:
    """(seconds to the first token, whole text) of a streamed chat completion."""
    first, parts, t0 = None, [], time.monotonic()
    async with rapp.client.stream("POST", "/v1/chat/completions", headers=rapp.headers(key), json={
            "model": model, "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0,
            "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"].get("content")
            if delta:
                first = first if first is not None else time.monotonic() - t0
                parts.append(delta)
    assert first is not None
    return first, "".join(parts)


async def test_uploaded_adapter_answers_within_a_second_like_offline(tmp_path, tiny_model, engine):
    async with registry_app(tmp_path, tiny_model["model_dir"], engine=engine, max_lora_rank=64) as rapp:
        alice = await rapp.tenant("alice")
        base = await _chat(rapp, alice, rapp.services.base_model_id)  # warm the engine
        assert base.status_code == 200, base.text
        config, weights = adapter_files(tiny_model, 0)

        t0 = time.monotonic()
        up = await rapp.upload(alice, "story", config=config, weights=weights)
        upload_s = time.monotonic() - t0
        assert up.status_code == 201, up.text
        ttft_s, streamed = await _stream_chat(rapp, alice, "story")
        # once the upload has answered 201, the adapter answers (first token, loaded from the store) within a
        # second: no restart, no propagation delay. The upload itself takes ~20 ms here when the machine is
        # quiet; it is bounded loosely because the suite shares two cores.
        assert ttft_s < 1.0, f"first token {ttft_s:.2f} s after the upload"
        assert upload_s < 5.0, f"upload took {upload_s:.2f} s"
        r = await _chat(rapp, alice, "story")
        assert r.status_code == 200 and r.json()["model"] == "story"
        answer = r.json()["choices"][0]["message"]["content"]
        assert streamed == answer

        prompt_ids = engine.apply_chat_template(MESSAGES)
        text, token_ids = await asyncio.to_thread(_offline_text, tiny_model, prompt_ids, 0)
        assert answer == text and r.json()["usage"]["completion_tokens"] == len(token_ids)
        assert answer != base.json()["choices"][0]["message"]["content"]  # the adapter really changed the output

        # delete: the next call is a 404 and the engine has dropped the version
        lora_int_id = (await rapp.services.models.resolve(
            await _principal(rapp, alice), "story")).lora_request.lora_int_id
        manager = engine.engine.runner.lora_manager
        assert lora_int_id in manager.host_cache
        assert (await rapp.client.delete("/v1/adapters/story", headers=rapp.headers(alice))).status_code == 200
        assert (await _chat(rapp, alice, "story")).status_code == 404
        # the engine releases a finished request's adapter pin at its next step; give it one
        assert (await _chat(rapp, alice, rapp.services.base_model_id)).status_code == 200
        for _ in range(50):
            if lora_int_id not in manager.host_cache:
                break
            await asyncio.sleep(0.02)
        assert lora_int_id not in manager.host_cache and lora_int_id not in manager.resident_adapter_ids()


async def _principal(rapp, key):
    return await rapp.services.authenticator.authenticate(key)


async def test_a_delete_lets_a_running_stream_finish(tmp_path, tiny_model, engine):
    async with registry_app(tmp_path, tiny_model["model_dir"], engine=engine, max_lora_rank=64) as rapp:
        key = await rapp.tenant("alice")
        config, weights = adapter_files(tiny_model, 1)
        assert (await rapp.upload(key, "busy", config=config, weights=weights)).status_code == 201
        finish, tokens, deleted = None, 0, None
        async with rapp.client.stream("POST", "/v1/chat/completions", headers=rapp.headers(key), json={
                "model": "busy", "messages": MESSAGES, "max_tokens": 24, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}, "ignore_eos": True}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk["choices"]:
                    finish = choice.get("finish_reason") or finish
                    if deleted is None and choice["delta"].get("content"):
                        deleted = await rapp.client.delete("/v1/adapters/busy", headers=rapp.headers(key))
        assert deleted is not None and deleted.status_code == 200
        assert finish == "length" and tokens == 24  # the stream ran to the end after the delete
        assert (await _chat(rapp, key, "busy")).status_code == 404
