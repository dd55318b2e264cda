"""Tensor parallelism on the CPU (gloo, two processes): the shard functions put every weight and adapter
tensor in exactly one place, and the engine over two ranks gives the single-process engine's greedy tokens (with
adapters of mixed ranks and targets, a removal, preemption) and close logprobs."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
import torch

from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.engine import parallel
from loraplex.engine.parallel import TPInfo, local_hf_config, shard_checkpoint_tensor, shard_lora_pair
from loraplex.engine.weights import iter_tensors
from tests.conftest import adapter_dir


def _joined(name: str, tensor: torch.Tensor, size: int, cfg: dict) -> torch.Tensor:
    """The shards of every rank put back together the way the model sums or concatenates them."""
    parts = [shard_checkpoint_tensor(name, tensor, parallel.with_layout(TPInfo(r, size), cfg)) for r in range(size)]
    if ".o_proj.bias" in name or ".down_proj.bias" in name:
        return sum(parts)  # rank 0 holds the bias, the all-reduce adds it once
    if ".o_proj." in name or ".down_proj." in name:
        return torch.cat(parts, dim=1)
    if (".layers." in name and any(m in name for m in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"))
            or name == "lm_head.weight"):  # column-parallel rows; the vocabulary-parallel head's rows
        return torch.cat(parts, dim=0)
    assert all(p is tensor for p in parts)  # replicated
    return tensor


def test_checkpoint_shards_rebuild_every_tensor(tiny_model):
    cfg = json.loads((Path(tiny_model["model_dir"]) / "config.json").read_text())
    for name, tensor in iter_tensors(tiny_model["model_dir"]):
        assert torch.equal(_joined(name, tensor, 2, cfg), tensor), name


def test_lora_shards_sum_to_the_whole_delta():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 32, generator=gen)
    for module in ("q_proj", "o_proj", "down_proj", "up_proj"):
        a, b = torch.randn(8, 32, generator=gen), torch.randn(48, 8, generator=gen)
        whole = x @ a.t() @ b.t()
        pieces = [shard_lora_pair(module, a, b, TPInfo(r, 2)) for r in range(2)]
        if module in parallel.ROW_PARALLEL_MODULES:  # each rank's input columns, summed by the all-reduce
            got = sum(x[:, r * 16:(r + 1) * 16] @ pa.t() @ pb.t() for r, (pa, pb) in enumerate(pieces))
        else:  # each rank's output rows, side by side
            got = torch.cat([x @ pa.t() @ pb.t() for pa, pb in pieces], dim=1)
        torch.testing.assert_close(got, whole)


def test_vocab_parallel_only_for_an_untied_head_that_divides():
    cfg = {"vocab_size": 512, "tie_word_embeddings": False, "num_attention_heads": 4}
    assert parallel.vocab_parallel(cfg, 2) and parallel.vocab_parallel(cfg, 4)
    assert not parallel.vocab_parallel(cfg, 1) and not parallel.vocab_parallel({**cfg, "vocab_size": 513}, 2)
    assert not parallel.vocab_parallel({**cfg, "tie_word_embeddings": True}, 2)  # the embedding table: replicated
    head = torch.arange(513 * 2, dtype=torch.float32).view(513, 2)
    odd = parallel.with_layout(TPInfo(1, 2), {**cfg, "vocab_size": 513})
    assert shard_checkpoint_tensor("lm_head.weight", head, odd) is head  # not divisible: whole
    even = parallel.with_layout(TPInfo(1, 2), cfg)
    assert torch.equal(shard_checkpoint_tensor("lm_head.weight", head[:512], even), head[256:512])


def test_local_config_and_limits(tiny_model):
    cfg = json.loads((Path(tiny_model["model_dir"]) / "config.json").read_text())
    local = local_hf_config(cfg, 2)
    assert local["num_attention_heads"] == cfg["num_attention_heads"] // 2
    assert local["num_key_value_heads"] == cfg["num_key_value_heads"] // 2
    assert local["intermediate_size"] == cfg["intermediate_size"] // 2
    assert local["head_dim"] == cfg["hidden_size"] // cfg["num_attention_heads"]
    with pytest.raises(ValueError, match="tensor_parallel_size 3 must divide the model's num_attention_heads"):
        LLM(tiny_model["model_dir"], tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        LLM(tiny_model["model_dir"], tensor_parallel_size=0)


@pytest.mark.parametrize("size", [2, 4])
def test_fewer_kv_heads_than_ranks_replicates_each_kv_head(tiny_qwen2, tiny_model, size):
    """MQA (1 KV head) over 2 and 4 ranks, and GQA (2 KV heads) over 4: rank r keeps its 1/P of the query heads and
    the whole KV head r // (P / KV heads), weights, biases and LoRA B rows alike; the local config has one KV head;
    q, gate, up and the row-parallel modules shard as without replication."""
    for model in (tiny_qwen2, tiny_model):
        cfg = json.loads((Path(model["model_dir"]) / "config.json").read_text())
        heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
        if kv_heads >= size:
            continue
        replicas = parallel.kv_replicas(cfg, size)
        assert replicas == size // kv_heads and local_hf_config(cfg, size)["num_key_value_heads"] == 1
        head_dim = cfg["hidden_size"] // heads
        infos = [TPInfo(r, size, replicas) for r in range(size)]
        seen = set()
        for name, tensor in iter_tensors(model["model_dir"]):
            parts = [shard_checkpoint_tensor(name, tensor, info) for info in infos]
            if ".k_proj." in name or ".v_proj." in name:
                for r, part in enumerate(parts):
                    head = r // replicas
                    assert torch.equal(part, tensor[head * head_dim:(head + 1) * head_dim]), (name, r)
                seen.add("kv")
            elif ".q_proj." in name:
                assert torch.equal(torch.cat(parts, dim=0), tensor)
                seen.add("q")
        assert seen == {"kv", "q"}
        gen = torch.Generator().manual_seed(1)
        a, b = torch.randn(4, cfg["hidden_size"], generator=gen), torch.randn(kv_heads * head_dim, 4, generator=gen)
        for r, info in enumerate(infos):
            pa, pb = shard_lora_pair("v_proj", a, b, info)
            head = r // replicas
            assert pa is a and torch.equal(pb, b[head * head_dim:(head + 1) * head_dim])
    with pytest.raises(ValueError, match="must divide the model's num_key_value_heads \\(2\\) or be a multiple"):
        parallel.check_shardable({"num_attention_heads": 12, "num_key_value_heads": 2, "intermediate_size": 96}, 3)


@pytest.mark.parametrize("model, size", [("tiny_qwen2", 2), ("tiny_model", 4)], ids=["mqa-2-ranks", "gqa-4-ranks"])
def test_ranks_sharing_kv_heads_equal_one(model, size, request):
    """Qwen2-style MQA (4 query heads, 1 KV head, q|k|v bias) over two ranks, and the Llama GQA model (4 query heads,
    2 KV heads) over four, each rank with one query head and KV head r // 2: with adapters (k and v among their
    targets), the single-process engine's greedy tokens and logprobs."""
    manifest = request.getfixturevalue(model)
    kw = dict(dtype="float32", enable_lora=True, max_loras=2, max_num_batched_tokens=48, seed=3)
    prompts = [{"prompt_token_ids": p} for p in _prompts()]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=1)
    loras = [LoRARequest("a0", 1, adapter_dir(manifest, 0)), None, LoRARequest("a1", 2, adapter_dir(manifest, 1)),
             LoRARequest("a0", 1, adapter_dir(manifest, 0)), None]
    want = LLM(manifest["model_dir"], **kw).generate(prompts, params, lora_request=loras)
    with LLM(manifest["model_dir"], tensor_parallel_size=size, **kw) as many:
        assert many.engine.runner.model_config.num_kv_heads == 1 and many.engine.runner.tp.kv_replicas == 2
        got = many.generate(prompts, params, lora_request=loras)
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for lw, lg in zip(w.outputs[0].logprobs, g.outputs[0].logprobs):
            tok = next(iter(lw))
            assert abs(lw[tok].logprob - lg[tok].logprob) < 1e-4


def _prompts():
    return [[1] + list(range(10 + 7 * i, 10 + 7 * i + n)) for i, n in enumerate((3, 30, 17, 60, 9))]


def test_two_ranks_equal_one(tiny_model):
    kw = dict(dtype="float32", enable_lora=True, max_loras=2, max_num_batched_tokens=48, seed=3, num_kv_blocks=8,
              max_model_len=96)
    prompts = [{"prompt_token_ids": p} for p in _prompts()]
    params = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True, logprobs=1)
    loras = [None, LoRARequest("a0", 1, adapter_dir(tiny_model, 0)), LoRARequest("a3", 4, adapter_dir(tiny_model, 3)),
             LoRARequest("a5", 6, adapter_dir(tiny_model, 5)), LoRARequest("a0", 1, adapter_dir(tiny_model, 0))]
    one = LLM(tiny_model["model_dir"], **kw)
    want = one.generate(prompts, params, lora_request=loras)
    with LLM(tiny_model["model_dir"], tensor_parallel_size=2, **kw) as two:
        assert two.engine.runner.model_config.num_heads == one.engine.runner.model_config.num_heads // 2
        vocab = one.engine.runner.model_config.vocab_size  # the untied LM head is split by vocabulary rows
        assert two.engine.runner.model.lm_head.shape[0] == vocab // 2 and two.engine.runner.model.gather_vocab
        got = two.generate(prompts, params, lora_request=loras)
        assert two.engine.counters["num_preemptions"] > 0  # 8 blocks of 16 tokens: the tight cache preempts
        for w, g in zip(want, got):
            assert g.outputs[0].token_ids == w.outputs[0].token_ids
            for lw, lg in zip(w.outputs[0].logprobs, g.outputs[0].logprobs):
                tok = next(iter(lw))
                assert abs(lw[tok].logprob - lg[tok].logprob) < 1e-4
        # an adapter removed, then registered again under the same id with other weights: both ranks follow
        two.engine.remove_adapter(1)
        swapped = [LoRARequest("a0", 1, adapter_dir(tiny_model, 2))]
        again = two.generate(prompts[:1], params, lora_request=swapped)
        ref = one.generate(prompts[:1], params, lora_request=[LoRARequest("a2", 3, adapter_dir(tiny_model, 2))])
        assert again[0].outputs[0].token_ids == ref[0].outputs[0].token_ids
    assert not any(p.is_alive() for p in two.engine.tp_driver.procs)


def _state(pid: int) -> str | None:
    """The process's state letter from /proc (Linux), None when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _children(pid: int) -> set[int]:
    """Running processes whose parent is ``pid``."""
    kids = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            kids.add(int(stat.parent.name))
    return kids


@pytest.mark.parametrize("kind", ["thread", "process"])
async def test_server_engine_over_two_ranks_streams_and_stops_its_workers(tiny_model, kind):
    """The server's engine over two ranks, its loop in a thread (AsyncEngine) or in a process of its own
    (ProcessEngine, whose child starts the rank's worker): streams the offline API's tokens, and its shutdown
    stops the worker process."""
    from loraplex.engine.async_engine import AsyncEngine
    from loraplex.engine.config import EngineConfig
    from loraplex.engine.engine_process import ProcessEngine
    from loraplex.engine.protocol import EngineRequest

    config = EngineConfig(model=tiny_model["model_dir"], dtype="float32", tensor_parallel_size=2)
    if kind == "thread":
        eng = AsyncEngine.from_config(config)
        workers = [p.pid for p in eng.engine.tp_driver.procs]
    else:
        eng = ProcessEngine.from_config(config)
        workers = sorted(_children(eng.pid))  # the rank-1 worker (and multiprocessing's resource tracker)
        assert workers, "the engine process started no worker for rank 1"
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    try:
        streams = []
        for i, p in enumerate(_prompts()[:2]):
            streams.append([d async for d in eng.generate(EngineRequest(f"r{i}", p, params))])
    finally:
        await eng.shutdown()
    deadline = time.monotonic() + 10
    while any(_state(w) not in (None, "Z") for w in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(_state(w) in (None, "Z") for w in workers), "a worker outlived the engine's shutdown"
    offline = LLM(tiny_model["model_dir"], dtype="float32").generate([{"prompt_token_ids": p} for p in _prompts()[:2]],
                                                                      params)
    for deltas, want in zip(streams, offline):
        assert sum((d.token_ids for d in deltas), []) == want.outputs[0].token_ids


async def test_a_dead_rank_worker_ends_the_engine_process_not_the_server(tiny_model):
    """With the loop in a process of its own, a rank worker that dies takes down that process alone: open streams
    end with an error, the client reports the engine dead (the server's supervisor then starts a new one)."""
    import os
    import signal

    from loraplex.engine.config import EngineConfig
    from loraplex.engine.engine_process import ProcessEngine
    from loraplex.engine.protocol import EngineRequest

    eng = ProcessEngine.from_config(EngineConfig(model=tiny_model["model_dir"], dtype="float32", tensor_parallel_size=2))
    try:
        workers = sorted(_children(eng.pid))
        got = []

        async def consume():
            params = SamplingParams(max_tokens=100_000, temperature=0, ignore_eos=True)
            async for d in eng.generate(EngineRequest("long", [1, 40, 41], params)):
                got.append(d)

        task = asyncio.create_task(consume())
        while not got:
            await asyncio.sleep(0.01)
        for w in workers:  # the rank-1 worker (and the resource tracker, which the engine does not depend on)
            os.kill(w, signal.SIGKILL)
        await asyncio.wait_for(task, 30)
        assert got[-1].finished and got[-1].finish_reason == "error"
        assert not eng.is_healthy()
        deadline = time.monotonic() + 30  # on gloo the collective fails rather than hangs: the loop stops itself
        while _state(eng.pid) not in (None, "Z") and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert _state(eng.pid) in (None, "Z"), "the engine process outlived its dead worker"
    finally:
        eng.close(timeout_s=5)


def test_serve_checks_the_flag():
    from loraplex.platform.cli import FlagError
    from loraplex.platform.cli_serve import check_serve_settings
    from loraplex.settings import Settings

    with pytest.raises(FlagError, match="--tensor-parallel-size / LORAPLEX_TENSOR_PARALLEL_SIZE"):
        check_serve_settings(Settings(tensor_parallel_size=0))


def test_two_ranks_with_drafts_and_int8_weights(tiny_model):
    """Speculative decoding over two ranks: the verify steps (several tokens per sequence) give the one-process
    engine's greedy tokens. INT8 weights over two ranks: the row-parallel shards take their own row scales (each
    rank's columns), so tokens may differ from one process by rounding; the run completes and its logprobs stay
    close to the unquantized engine's."""
    from tests.unit.engine.test_spec_decode import _prompts as spec_prompts

    kw = dict(dtype="float32", max_num_batched_tokens=64, seed=2)
    prompts = [{"prompt_token_ids": p} for p in spec_prompts(4)]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(tiny_model["model_dir"], **kw).generate(prompts, params)]
    with LLM(tiny_model["model_dir"], tensor_parallel_size=2, num_speculative_tokens=3, prompt_lookup_min=1,
             **kw) as two:
        got = [o.outputs[0].token_ids for o in two.generate(prompts, params)]
        assert got == want
        sched = two.engine.scheduler
        assert 0 < sched.num_accepted_tokens < sched.num_draft_tokens
    first = SamplingParams(max_tokens=1, temperature=0, logprobs=1)
    plain = LLM(tiny_model["model_dir"], **kw).generate(prompts, first)
    with LLM(tiny_model["model_dir"], tensor_parallel_size=2, quantization="int8", **kw) as two:
        quant = two.generate(prompts, first)
    for p, q in zip(plain, quant):  # the greedy token's logprob (the first entry: the sampled token's)
        assert abs(next(iter(p.outputs[0].logprobs[0].values())).logprob
                   - next(iter(q.outputs[0].logprobs[0].values())).logprob) < 0.05


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "overlapped"])
def test_two_ranks_many_sequences_through_few_rows(tiny_model, async_scheduling):
    """More sequences over time than the step has rows (max_num_seqs 3, 10 requests): the workers' mirrored
    requests finish with rank 0's, so their block-table rows are reused; overlapped steps (placeholders filled on
    the device from each rank's own samples) give the same tokens."""
    kw = dict(dtype="float32", max_num_seqs=3, max_num_batched_tokens=40, seed=5, async_scheduling=async_scheduling)
    prompts = [{"prompt_token_ids": [1] + list(range(20 + 3 * i, 20 + 3 * i + n))}
               for i, n in enumerate((4, 9, 22, 5, 13, 31, 2, 17, 8, 11))]
    params = SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(tiny_model["model_dir"], **kw).generate(prompts, params)]
    with LLM(tiny_model["model_dir"], tensor_parallel_size=2, **kw) as two:
        got = [o.outputs[0].token_ids for o in two.generate(prompts, params)]
        # finished requests are forgotten by the next step's message: only the last step's may remain
        assert len(two.engine.tp_driver.sender._sent) <= 3
        if async_scheduling:
            assert two.engine.num_overlapped_steps > 0
    assert got == want


def test_step_messages_mirror_requests():
    """The step messages alone (no model): a worker's mirror follows appends, a trailing placeholder replaced by
    its token, trimmed and replaced block lists, preemption and finishing."""
    from loraplex.engine.parallel import StepReceiver, StepSender
    from loraplex.engine.request import Request, RequestStatus
    from loraplex.engine.scheduler_output import PLACEHOLDER_TOKEN, ScheduledRequest, SchedulerOutput

    a = Request("a", [1, 2, 3], SamplingParams(max_tokens=8))
    b = Request("b", [4, 5], SamplingParams(max_tokens=8, prompt_logprobs=1))
    for r in (a, b):
        r.status = RequestStatus.RUNNING
    sender, mirror = StepSender(), StepReceiver()

    def step(*scheduled):
        out = mirror.apply(sender.message(SchedulerOutput(scheduled=[ScheduledRequest(r, n, 1) for r, n in scheduled])))
        for s, (r, n) in zip(out.scheduled, scheduled):
            m = s.request
            assert (m.seq_id, m.token_ids, m.block_ids, m.num_computed_tokens, s.num_new_tokens) == (
                r.seq_id, r.token_ids, r.block_ids, r.num_computed_tokens, n)
        return out

    a.block_ids = [7]
    b.block_ids = [9]
    step((a, 3), (b, 2))
    a.num_computed_tokens, b.num_computed_tokens = 3, 2
    a.token_ids.append(PLACEHOLDER_TOKEN)  # overlapped: sampled on the device, not known on the host yet
    b.token_ids.append(11)
    b.prompt_logprobs = [None, object()]
    rows_before = mirror.requests[a.seq_id].block_ids
    a.block_ids.append(8)
    out = step((a, 1), (b, 1))
    assert out.scheduled[0].request.block_ids is rows_before  # appended in place
    assert len(out.scheduled[1].request.prompt_logprobs) == 2
    a.token_ids[-1] = 42  # the real token arrives, the next placeholder follows
    a.token_ids.append(PLACEHOLDER_TOKEN)
    a.num_computed_tokens = 4
    step((a, 1))
    assert mirror.requests[a.seq_id].token_ids == [1, 2, 3, 42, PLACEHOLDER_TOKEN]
    del a.block_ids[1:]  # trimmed, then another list after preemption
    a.token_ids[-1] = 43
    step((a, 1))
    b.status = RequestStatus.PREEMPTED
    a.block_ids = [3, 4]
    a.num_computed_tokens = 0
    step((a, 5))
    assert mirror.requests[b.seq_id].status is RequestStatus.PREEMPTED
    a.status = RequestStatus.FINISHED_LENGTH
    step((b, 3))
    assert a.seq_id not in mirror.requests and a.seq_id not in sender._sent


def test_two_ranks_forks_prefix_cache_and_merged_adapter(tiny_model):
    """Parallel sampling (forks share blocks copy-on-write: the block copies reach every rank), prefix-cache hits
    across requests, and one adapter folded into each rank's weight shards (``merge_single_lora``): the one-process
    engine's tokens."""
    kw = dict(dtype="float32", enable_lora=True, max_loras=2, seed=4, max_num_batched_tokens=64,
              merge_single_lora=True)
    shared = [1] + list(range(100, 140))
    prompts = [{"prompt_token_ids": shared + [7, 8]}, {"prompt_token_ids": shared + [9]}]
    fork = SamplingParams(n=2, max_tokens=10, temperature=0.9, seed=11, ignore_eos=True)
    lora = LoRARequest("a1", 2, adapter_dir(tiny_model, 1))

    def run(llm):
        outs = llm.generate(prompts[:1], fork) + llm.generate(prompts[1:], fork)  # the second hits the cache
        merged = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
                              lora_request=[lora, lora])
        return [[c.token_ids for c in o.outputs] for o in outs + merged], llm.engine.counters

    want, _ = run(LLM(tiny_model["model_dir"], **kw))
    with LLM(tiny_model["model_dir"], tensor_parallel_size=2, **kw) as two:
        got, counters = run(two)
    assert got == want
    assert counters["prefix_cache_hit_tokens"] > 0


def test_a_dead_worker_is_noticed(tiny_model):
    """A worker that dies would leave rank 0 blocked in its next collective: the driver's watchdog calls
    ``on_worker_death`` (a server: SIGTERM to itself, so it drains and exits, and is restarted)."""
    import threading

    llm = LLM(tiny_model["model_dir"], dtype="float32", tensor_parallel_size=2)
    driver = llm.engine.tp_driver
    noticed = threading.Event()
    driver.on_worker_death = noticed.set
    driver.procs[0].kill()
    assert noticed.wait(timeout=10)
    driver.abort()


def test_add_lora_and_pin_lora_reach_every_rank(tiny_model, tmp_path):
    """vLLM's add_lora reads the adapter now, so its files may go once it returns: every rank must have read its
    shard by then (the other ranks used to read at the first step that used it, from files gone by then), and
    pin_lora holds it on every rank."""
    import shutil

    kw = dict(dtype="float32", enable_lora=True, max_loras=2, seed=5, num_kv_blocks=16, max_model_len=96)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": [1] + list(range(60, 80))}]
    want = LLM(tiny_model["model_dir"], **kw).generate(prompts, params,
                                                        lora_request=LoRARequest("a3", 4, adapter_dir(tiny_model, 3)))
    with LLM(tiny_model["model_dir"], tensor_parallel_size=2, **kw) as two:
        for lora_id, index in ((4, 3), (5, 4)):
            copy = tmp_path / f"a{index}"
            shutil.copytree(adapter_dir(tiny_model, index), copy)
            assert two.llm_engine.add_lora(LoRARequest(f"a{index}", lora_id, str(copy))) is True
        assert two.llm_engine.pin_lora(4) is True
        shutil.rmtree(tmp_path / "a3")
        shutil.rmtree(tmp_path / "a4")
        got = two.generate(prompts, params, lora_request=LoRARequest("a3", 4, str(tmp_path / "a3")))
        assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids, got[0].outputs[0]
        other = two.generate(prompts, params, lora_request=LoRARequest("a4", 5, str(tmp_path / "a4")))
        assert other[0].outputs[0].finish_reason == "length"  # added, not pinned: every rank serves it too
        assert two.llm_engine.list_loras() == {4, 5}
