"""Slot fills on the copy stream (CUDA): a prefetched fill gives the synchronous path's results, a step
waits for the fills of its own adapters (right after a fill its output is already correct) but not for
the fills of other adapters, a fill is one host->device transfer, and the engine with CUDA graphs and slot
prefetch produces the tokens of the synchronous path."""

from __future__ import annotations

import pytest
import torch

from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.adapters.manager import LoRAManager
from tests.conftest import adapter_dir
from tests.gpu.test_cuda_graphs import _compare


@pytest.fixture(scope="module")
def hf_config(tiny_model):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(tiny_model["model_dir"])


def _loras(tiny_model, n: int) -> list[LoRARequest]:
    return [LoRARequest(f"a{i}", i + 1, adapter_dir(tiny_model, i)) for i in range(n)]


def _manager(hf_config, loras, max_loras: int = 4) -> LoRAManager:
    mgr = LoRAManager(hf_config, max_loras=max_loras, max_lora_rank=64, max_cpu_loras=8, device="cuda",
                      dtype=torch.float32)
    for lora in loras:
        mgr.validate_and_prefetch(lora)
    return mgr


def _add(mgr: LoRAManager, ids: list[int], seed: int = 0) -> torch.Tensor:
    """One qkv LoRA application of layer 0 for these per-token adapter ids, on the current stream."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(len(ids), mgr.shapes.hidden_size, generator=gen).cuda()
    base = torch.randn(len(ids), sum(mgr.shapes.slice_widths("qkv")), generator=gen).cuda()
    step = mgr.prepare_step(torch.tensor(ids, device="cuda"), adapter_ids=sorted(set(ids) - {0}))
    return step.add(0, "qkv", x, base)


def _busy_copy_stream(mgr: LoRAManager, num_bytes: int = 2 << 30) -> tuple[torch.Tensor, torch.Tensor]:
    """Queue a large pinned host->device copy on the manager's copy stream: fills queued after it finish
    tens of milliseconds later."""
    host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    with torch.cuda.stream(mgr.pool._copy_stream):
        dev.copy_(host, non_blocking=True)
    return host, dev


def test_step_waits_for_its_own_fill_and_not_for_others(tiny_model, hf_config):
    loras = _loras(tiny_model, 3)
    mgr, sync = _manager(hf_config, loras), _manager(hf_config, loras)
    want = _add(sync, [2, 0, 2, 1])
    _add(mgr, [1, 1, 0])  # adapter 1 resident, kernels compiled
    torch.cuda.synchronize()
    keep_alive = _busy_copy_stream(mgr)
    mgr.poll([loras[1]])
    assert mgr.prefetch_slots() == 1  # adapter 2 into a fresh slot (ranks 0 there until the fill lands)
    fill_done = mgr.pool._pending_fills[mgr._slot_of[2]][0]
    # a step of adapter 1 alone does not wait for adapter 2's fill (no blanket wait on the copy stream)
    other = _add(mgr, [1, 0, 1])
    finished = torch.cuda.Event()
    finished.record()
    finished.synchronize()
    assert not fill_done.query(), "the step of adapter 1 waited for adapter 2's fill"
    # right after, a step of adapter 2: its output is already the filled adapter's (it waited for the fill)
    got = _add(mgr, [2, 0, 2, 1])
    torch.cuda.synchronize()
    assert torch.equal(got, want)
    assert torch.equal(other, _add(sync, [1, 0, 1]))
    del keep_alive


def test_prefetched_fill_equals_synchronous_fill_and_is_one_transfer(tiny_model, hf_config):
    loras = _loras(tiny_model, 6)
    mgr, sync = _manager(hf_config, loras), _manager(hf_config, loras)
    mgr.poll(loras[:4])
    assert mgr.prefetch_slots() == 4 and mgr.num_prefetched_loads == 4
    for ids in ([1, 2, 0, 3, 4], [4, 4, 1, 0]):
        assert torch.equal(_add(mgr, ids), _add(sync, ids))
    assert mgr.num_loads == 4  # the steps used the prefetched slots
    adapter = mgr.host_cache.get(5)
    assert adapter.buffer.is_pinned()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        mgr.pool.fill(0, adapter)
        torch.cuda.synchronize()
    copies = [e for e in prof.events() if "Memcpy HtoD" in e.name]
    assert len(copies) == 1, [e.name for e in prof.events()]


def test_engine_with_graphs_and_prefetch_matches_the_synchronous_path(tiny_model):
    loras = _loras(tiny_model, 6)
    gen = torch.Generator().manual_seed(0)
    prompts, mix = [], []
    for i in range(24):
        length = int(torch.randint(1, 60, (1,), generator=gen))
        prompts.append({"prompt_token_ids": [1] + torch.randint(8, 500, (length,), generator=gen).tolist()})
        mix.append(None if i % 5 == 4 else loras[(i * 7) % 6])
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)

    def llm(eager: bool) -> LLM:
        return LLM(tiny_model["model_dir"], device="cuda", dtype="float32", enable_lora=True, max_loras=2,
                   max_cpu_loras=3, max_num_seqs=8, enforce_eager=eager)

    reference = llm(eager=True)
    ref_manager = reference.engine.runner.get_lora_manager()
    ref_manager.prefetch_slots = lambda: 0  # the synchronous path: slots filled only when a step needs them
    prefetching = llm(eager=False)
    compared = _compare(reference.generate(prompts, params, lora_request=mix),
                        prefetching.generate(prompts, params, lora_request=mix), "float32")
    assert compared == sum(12 for _ in prompts)
    manager = prefetching.engine.runner.lora_manager
    assert manager.num_prefetched_loads > 0 and manager.num_evictions > 0
    assert ref_manager.num_prefetched_loads == 0
    assert prefetching.engine.runner.graphs.num_replays > 0



def test_fill_transfer_does_not_wait_for_queued_steps(tiny_model, hf_config):
    """The PCIe transfer of a fill starts while the current stream is still busy (only the device-side copies into
    the slot wait for it), a step that waits for the fill sees the adapter, and staging is bounded."""
    loras = _loras(tiny_model, 3)
    mgr, sync = _manager(hf_config, loras), _manager(hf_config, loras)
    _add(sync, [2, 0, 2, 1])  # the reference: adapter 2 filled while nothing else ran
    ref_slot = sync._slot_of[2]
    _add(mgr, [1, 1, 0])
    torch.cuda.synchronize()
    adapter, pool, slot = mgr.host_cache.get(2), mgr.pool, 3
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU cycles on the current stream: a long running step
    busy_until = torch.cuda.Event()
    busy_until.record()
    pool.fill(slot, adapter)
    pool._copy_stream.synchronize()  # the transfer is done ...
    assert not busy_until.query(), "the transfer waited for the kernels queued on the current stream"
    assert not pool._pending_fills[slot][0].query(), "the copies into the slot ran before its earlier readers"
    pool.wait_for_fills([slot])
    done = torch.cuda.Event()
    done.record()
    done.synchronize()
    for proj in pool.a:
        assert torch.equal(pool.a[proj][:, slot], sync.pool.a[proj][:, ref_slot]), proj
        assert torch.equal(pool.bt[proj][:, slot], sync.pool.bt[proj][:, ref_slot]), proj
    assert torch.equal(pool.ranks[:, :, slot], sync.pool.ranks[:, :, ref_slot])
    # staging bound: with room for one buffer only, the next fill first waits for the oldest staged copies
    pool.max_staged_bytes = adapter.buffer.numel()
    pool.fill(slot, adapter)
    pool.fill(slot, adapter)
    assert len(pool._staged) == 1 and pool._staged_bytes == adapter.buffer.numel()
    torch.cuda.synchronize()


def test_prefetch_never_waits_on_the_host_for_staging(tiny_model, hf_config):
    """With the staging buffers full of copies that wait behind a long-running step, slot prefetch returns at
    once with nothing filled (a deferral), and fills once the copies have run."""
    import time

    loras = _loras(tiny_model, 3)
    mgr = _manager(hf_config, loras)
    pool = mgr.pool
    first = mgr.host_cache.get(1)
    pool.max_staged_bytes = first.buffer.numel()  # room for one staged buffer
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU cycles on the current stream
    pool.fill(3, first)  # staged: its copies into the slot wait behind the sleep
    assert not pool.can_fill_now(mgr.host_cache.get(2))
    mgr.poll([lr for lr in loras[1:]])
    start = time.perf_counter()
    assert mgr.prefetch_slots() == 0
    assert time.perf_counter() - start < 0.2, "prefetch waited on the host"
    assert mgr.num_prefetch_deferrals == 1
    torch.cuda.synchronize()
    assert pool.can_fill_now(mgr.host_cache.get(2))
    filled = mgr.prefetch_slots()  # room for one buffer: the second fill waits unless the first already ran
    torch.cuda.synchronize()
    filled += mgr.prefetch_slots()
    assert filled == 2 and sorted(mgr.resident_adapter_ids()) == [2, 3]
