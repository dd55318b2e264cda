"""LoRAManager's background reads and slot prefetch on the CPU, with real adapter files: submit returns
before the read, one read per file for many ids, failures reported once and not remembered, removal and
replacement while a read is in flight, slot prefetch that never takes a pinned or soon-needed slot, the
packed host layout, and a host cache counted in distinct copies."""

from __future__ import annotations

import time

import pytest
import torch

from loraplex.adapters import AdapterError
from loraplex.adapters.host_cache import HostLRUCache
from loraplex.adapters.loader import load_adapter
from loraplex.adapters.manager import LoRAManager
from loraplex.adapters.modules import BaseShapes
from loraplex.adapters.packed import pack_adapter
from loraplex.adapters.slot_pool import SlotPool
from loraplex.engine.lora_request import LoRARequest
from tests.conftest import adapter_dir, nan_adapter
from tests.unit.adapters.held_reads import hold


@pytest.fixture(scope="module")
def hf_config(tiny_model):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(tiny_model["model_dir"])


def _manager(hf_config, max_loras=4, max_cpu_loras=8) -> LoRAManager:
    return LoRAManager(hf_config, max_loras=max_loras, max_lora_rank=64, max_cpu_loras=max_cpu_loras,
                       device="cpu", dtype=torch.float32, num_load_workers=2)


def _until_ready(mgr: LoRAManager, reqs: list[LoRARequest], timeout: float = 20.0) -> dict[int, str]:
    """Poll as the scheduler does, step after step, until every request's adapter is ready or failed (the
    scheduler passes the requests still waiting: those with a ready adapter have been admitted)."""
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        failures.update(mgr.poll(r for r in reqs if r.lora_int_id not in failures and not mgr.is_ready(r.lora_int_id)))
        if all(mgr.is_ready(r.lora_int_id) or r.lora_int_id in failures for r in reqs):
            return failures
        mgr.wait_for_load(0.5)
    raise AssertionError("adapters never became ready")


def _delta(mgr: LoRAManager, adapter_id: int) -> torch.Tensor:
    """The qkv delta of layer 0 for a fixed input, through the manager's slots."""
    x = torch.randn(1, mgr.shapes.hidden_size, generator=torch.Generator().manual_seed(0))
    out = torch.zeros(1, sum(mgr.shapes.slice_widths("qkv")))
    return mgr.prepare_step(torch.tensor([adapter_id])).add(0, "qkv", x, out)


def test_submit_returns_before_the_read_and_poll_brings_the_adapter_in(tiny_model, hf_config):
    mgr = _manager(hf_config)
    req = LoRARequest("a3", 4, adapter_dir(tiny_model, 3))
    held = hold(mgr, req.lora_path)
    started = time.monotonic()
    mgr.submit(req)
    assert time.monotonic() - started < 1.0  # the read is blocked: a synchronous submit would hang here
    assert held.started.wait(10)
    assert mgr.poll([req]) == {} and not mgr.is_ready(4)
    assert mgr.num_pending_loads == 1 and mgr.num_loading_adapters == 1 and mgr.num_host_loads == 0
    held.release()
    assert _until_ready(mgr, [req]) == {}
    assert mgr.num_pending_loads == 0 and mgr.num_loading_adapters == 0
    assert mgr.num_host_loads == 1 and mgr.host_load_seconds > 0
    sync = _manager(hf_config)
    sync.validate_and_prefetch(req)
    assert torch.equal(_delta(mgr, 4), _delta(sync, 4)) and _delta(mgr, 4).abs().sum() > 0


def test_many_ids_over_few_files_read_each_file_once(tiny_model, hf_config):
    mgr = _manager(hf_config, max_cpu_loras=4)
    reqs = [LoRARequest(f"t{k}", k + 1, adapter_dir(tiny_model, k % 3)) for k in range(60)]
    for r in reqs:
        mgr.submit(r)
    assert mgr.num_loading_adapters <= 2  # a burst starts no more reads than there are workers
    assert _until_ready(mgr, reqs) == {}
    assert mgr.num_host_loads == 3 and mgr.num_host_reuses == 57
    # 60 ids share 3 copies: the host cache (4 copies) holds every id without evicting
    assert len(mgr.host_cache) == 60 and mgr.host_cache.num_copies == 3
    assert torch.equal(_delta(mgr, 1), _delta(mgr, 58)) and not torch.equal(_delta(mgr, 1), _delta(mgr, 2))


def test_failed_read_fails_once_and_is_not_remembered(tiny_model, hf_config, tmp_path):
    bad = nan_adapter(tiny_model, 1, tmp_path / "nan", weight="lora_A")
    mgr = _manager(hf_config)
    req, good = LoRARequest("bad", 9, str(bad)), LoRARequest("good", 2, adapter_dir(tiny_model, 1))
    mgr.submit(req)
    mgr.submit(good)
    failures = _until_ready(mgr, [req, good])
    assert list(failures) == [9] and "NaN" in failures[9] and mgr.num_load_failures == 1
    assert not mgr.is_ready(9) and mgr.num_loading_adapters == 0 and mgr.is_ready(2)
    assert mgr.poll([req]) == {}  # reported once; the next poll starts a new read of the (still bad) file
    assert "NaN" in _until_ready(mgr, [req])[9] and mgr.num_load_failures == 2
    with pytest.raises(AdapterError, match="NaN"):  # the synchronous path gives the same error
        mgr.validate_and_prefetch(req)


def test_removal_while_the_read_is_in_flight(tiny_model, hf_config):
    mgr = _manager(hf_config)
    old, new = adapter_dir(tiny_model, 0), adapter_dir(tiny_model, 2)
    held = hold(mgr, old)
    mgr.submit(LoRARequest("v1", 7, old))
    assert held.started.wait(10)
    with pytest.raises(AdapterError, match="another path"):  # the id is taken by the pending read
        mgr.submit(LoRARequest("other", 7, new))
    mgr.remove_adapter(7)
    assert mgr.num_loading_adapters == 0
    # a new version under the id: its read finishes first, the old read lands later and is ignored
    v2 = LoRARequest("v2", 7, new)
    mgr.submit(v2)
    assert _until_ready(mgr, [v2]) == {}
    held.release()
    deadline = time.monotonic() + 20
    while mgr.num_pending_loads and time.monotonic() < deadline:
        mgr.wait_for_load(0.5)
        mgr.poll([v2])
    assert mgr.num_pending_loads == 0 and mgr.num_host_loads == 2
    assert mgr.host_cache.get(7).rank == tiny_model["adapters"][2]["rank"]
    # removed while pending with nobody waiting: the finished read is not cached for the id
    held = hold(mgr, old)
    mgr.submit(LoRARequest("v3", 8, old))
    assert held.started.wait(10)
    mgr.remove_adapter(8)
    held.release()
    while mgr.num_pending_loads and time.monotonic() < deadline:
        mgr.wait_for_load(0.5)
        mgr.poll([])
    assert 8 not in mgr.host_cache and not mgr.is_ready(8) and mgr.num_host_loads == 3


def test_prefetch_takes_free_or_unneeded_slots_only(tiny_model, hf_config):
    mgr = _manager(hf_config, max_loras=2)
    reqs = [LoRARequest(f"a{i}", i + 1, adapter_dir(tiny_model, i)) for i in range(3)]
    for r in reqs:
        mgr.validate_and_prefetch(r)
    mgr.acquire(1)
    mgr.assign_slots([1, 2])
    mgr.poll([reqs[2], reqs[1]])  # waiting: adapter 3, then adapter 2
    assert mgr.prefetch_slots() == 0  # 1 is pinned, 2 is needed by a waiting request: nothing to evict
    mgr.poll([reqs[2]])
    assert mgr.prefetch_slots() == 1 and sorted(mgr.resident_adapter_ids()) == [1, 3]
    assert mgr.num_prefetched_loads == 1 and mgr.num_loads == 3 and mgr.num_evictions == 1
    loads = mgr.num_loads
    sync = _manager(hf_config)
    sync.validate_and_prefetch(reqs[2])
    assert torch.equal(_delta(mgr, 3), _delta(sync, 3))  # the prefetched slot serves the step
    assert mgr.num_loads == loads  # no second fill


@pytest.mark.parametrize("index", [0, 1, 2, 3])  # mixed ranks and target sets (some layers/slices empty)
def test_one_pass_packed_load_equals_load_then_pack(tiny_model, hf_config, index, tmp_path):
    from loraplex.adapters.packed import load_packed_adapter

    shapes = BaseShapes.from_config(hf_config)
    path = adapter_dir(tiny_model, index)
    for dtype in (torch.float32, torch.bfloat16):
        ref = pack_adapter(load_adapter(1, path, hf_config, 64, dtype=dtype), pin_memory=False)
        got = load_packed_adapter(1, path, shapes, 64, dtype=dtype, pin_memory=False)
        assert got.layout == ref.layout and got.spec == ref.spec
        for name, seg in ref.layout.items():  # byte for byte (the alignment padding between segments aside)
            assert torch.equal(seg.view(got.buffer).view(torch.uint8), seg.view(ref.buffer).view(torch.uint8)), name
        for proj in ref.a:
            assert (got.a[proj] is None) == (ref.a[proj] is None)
    # the buffer is reused memory: stale bytes where the adapter has no weights must be zeroed
    garbage = torch.full((got.buffer.numel(),), 0x7F, dtype=torch.uint8)
    real_empty = torch.empty
    def dirty_empty(*a, **kw):
        t = real_empty(*a, **kw)
        if t.dtype == torch.uint8:
            t.copy_(garbage[:t.numel()])
        return t
    import loraplex.adapters.packed as packed_mod
    packed_mod.torch.empty = dirty_empty
    try:
        dirty = load_packed_adapter(1, path, shapes, 64, dtype=torch.bfloat16, pin_memory=False)
    finally:
        packed_mod.torch.empty = real_empty
    for name, seg in ref.layout.items():
        assert torch.equal(seg.view(dirty.buffer).view(torch.uint8), seg.view(ref.buffer).view(torch.uint8)), name


def test_packed_adapter_is_one_buffer_and_fills_like_the_plain_layout(tiny_model, hf_config):
    plain = load_adapter(1, adapter_dir(tiny_model, 0), hf_config, 64, dtype=torch.float32)
    packed = pack_adapter(plain, pin_memory=False)
    for proj, a in plain.a.items():
        if a is not None:
            assert torch.equal(packed.a[proj], a) and packed.a[proj].untyped_storage().data_ptr() == \
                packed.buffer.untyped_storage().data_ptr()
            assert torch.equal(packed.bt[proj], plain.bt[proj])
    staged = packed.buffer.clone()  # what the device holds after the one transfer
    views = packed.device_views(staged)
    assert torch.equal(views["ranks"], plain.ranks) and views["scaling"].item() == plain.spec.scaling
    shapes = BaseShapes.from_config(hf_config)
    pools = [SlotPool(shapes, 2, 64, torch.device("cpu"), torch.float32) for _ in range(2)]
    pools[0].fill(1, plain)
    pools[1].fill(1, packed)
    for name in ("a", "bt"):
        for proj in getattr(pools[0], name):
            assert torch.equal(getattr(pools[0], name)[proj], getattr(pools[1], name)[proj])
    assert torch.equal(pools[0].ranks, pools[1].ranks) and torch.equal(pools[0].scaling, pools[1].scaling)
    assert pools[1].scaling[1] == plain.spec.scaling and pools[1].ranks[:, :, 1].max() == plain.rank


def test_host_cache_counts_copies_and_keeps_what_waiting_requests_need():
    cache: HostLRUCache[object] = HostLRUCache(2)
    x, y, z = object(), object(), object()
    for adapter_id, copy in ((1, x), (2, x), (3, y), (4, x)):
        assert cache.put(adapter_id, copy) == []
    assert len(cache) == 4 and cache.num_copies == 2
    assert cache.put(5, z, keep={1}) == [3]  # y is least recent without a kept id; x stays for id 1
    assert cache.put(6, y, keep=set()) == [1, 2, 4]  # x goes with every id holding it
    assert sorted(cache.ids()) == [5, 6] and cache.num_evictions == 4
    cache.pop(5)
    assert cache.num_copies == 1 and 5 not in cache


class _StagingFull(SlotPool):
    """The CUDA staging bound stood in for on the CPU (there is no copy stream here): room for ``room`` more
    fills, then none until ``room`` is set again (on CUDA: until the oldest staged copies have run)."""

    room = 1

    def can_fill_now(self, adapter) -> bool:
        return self.room > 0

    def fill(self, slot, adapter) -> None:
        self.room -= 1
        super().fill(slot, adapter)


def test_prefetch_stops_instead_of_waiting_when_staging_is_full(tiny_model, hf_config):
    mgr = _manager(hf_config, max_loras=4)
    mgr.pool.__class__ = _StagingFull
    reqs = [LoRARequest(f"a{i}", i + 1, adapter_dir(tiny_model, i)) for i in range(3)]
    for r in reqs:
        mgr.validate_and_prefetch(r)
    mgr.poll(reqs)
    assert mgr.prefetch_slots() == 1 and mgr.resident_adapter_ids() == [1]
    assert mgr.num_prefetch_deferrals == 1 and mgr.num_evictions == 0
    assert mgr.prefetch_slots() == 0 and mgr.num_prefetch_deferrals == 2  # still full: the step goes on
    mgr.pool.room = 5  # the staged copies have run
    assert mgr.prefetch_slots() == 2 and sorted(mgr.resident_adapter_ids()) == [1, 2, 3]
    assert mgr.num_prefetched_loads == 3 and mgr.num_loads == 3
    # a step's own fills never ask: assign_slots fills even with no room (on CUDA it may wait for staging)
    mgr.pool.room = 0
    extra = LoRARequest("a3", 4, adapter_dir(tiny_model, 3))
    mgr.validate_and_prefetch(extra)
    assert mgr.assign_slots([4]) and 4 in mgr.resident_adapter_ids()


def test_an_id_queued_behind_busy_loaders_is_still_taken_by_its_path(tiny_model, hf_config):
    """With every loader worker busy, submit queues an id without starting its read; a second request naming
    the same id with other files used to pass (nothing recorded the first path) and then ran with the first
    request's weights."""
    mgr = _manager(hf_config)  # 2 load workers
    held = hold(mgr, adapter_dir(tiny_model, 0), adapter_dir(tiny_model, 1))
    mgr.submit(LoRARequest("a0", 1, adapter_dir(tiny_model, 0)))
    mgr.submit(LoRARequest("a1", 2, adapter_dir(tiny_model, 1)))
    queued = LoRARequest("a2", 3, adapter_dir(tiny_model, 2))
    mgr.submit(queued)
    assert mgr.num_loading_adapters == 2  # id 3's read has not started
    with pytest.raises(AdapterError, match="another path"):
        mgr.submit(LoRARequest("other", 3, adapter_dir(tiny_model, 1)))
    mgr.submit(queued)  # the same path again is fine
    held.release()
    assert _until_ready(mgr, [queued]) == {}
    assert mgr.host_cache.get(3).rank == tiny_model["adapters"][2]["rank"]
    # a removed queued id may come back with other files (a new version)
    mgr.remove_adapter(3)
    mgr.submit(LoRARequest("v2", 3, adapter_dir(tiny_model, 3)))
    assert _until_ready(mgr, [LoRARequest("v2", 3, adapter_dir(tiny_model, 3))]) == {}
    assert mgr.host_cache.get(3).rank == tiny_model["adapters"][3]["rank"]


def test_a_refused_page_locked_buffer_falls_back_to_pageable_memory(caplog):
    """This CPU-only torch cannot page-lock memory (the same RuntimeError path as a CUDA driver refusing
    cudaHostAlloc): the adapter's buffer is pageable, of the asked size, and the refusal is logged."""
    from loraplex.adapters.packed import host_buffer

    with caplog.at_level("WARNING", logger="loraplex.adapters.packed"):
        buffer = host_buffer(4096, pin_memory=True)
    assert buffer.shape == (4096,) and buffer.dtype == torch.uint8 and not buffer.is_pinned()
    assert any("page-locked host buffer of 4096 bytes refused" in r.getMessage() for r in caplog.records)
    caplog.clear()
    assert host_buffer(16, pin_memory=False).shape == (16,) and not caplog.records


def test_an_unexpected_read_failure_is_logged_with_its_traceback(tiny_model, hf_config, tmp_path, caplog):
    """A refused adapter is the user's error (one line); any other exception in a read is ours and keeps its
    traceback in the log (an intermittent 'CUDA error' on the H200 was logged without the call that raised it)."""
    mgr = _manager(hf_config)

    def boom(path):
        if path.endswith("adapter-1"):
            raise RuntimeError("injected failure")

    mgr.loader.fault_injection_before_read = boom
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text("{not json")
    reqs = [LoRARequest("b", 2, adapter_dir(tiny_model, 1)), LoRARequest("c", 3, str(bad))]
    with caplog.at_level("WARNING", logger="loraplex.adapters.manager"):
        for r in reqs:
            mgr.submit(r)
        failures = _until_ready(mgr, reqs)
    assert set(failures) == {2, 3} and "injected failure" in failures[2]
    logged = {r.getMessage().split(" failed to load")[0]: r for r in caplog.records if "failed to load" in r.getMessage()}
    assert logged[f"adapter {adapter_dir(tiny_model, 1)}"].exc_info is not None
    assert logged[f"adapter {bad}"].exc_info is None
