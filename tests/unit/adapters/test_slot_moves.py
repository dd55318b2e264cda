"""Slot moves for the in-GEMM shrink (``LoRAManager._gather_low``, ``SlotPool.move``) on the CPU: a decode step's adapters
that sit at or above the GEMM width W they could fill move into the first W slots (a free one, else swapped with the
least recently used adapter there), and every adapter's delta is still its own PEFT math afterwards."""

from __future__ import annotations

import pytest
import torch

from loraplex.adapters.manager import LoRAManager
from loraplex.adapters.modules import PROJ_MODULES
from loraplex.engine.lora_request import LoRARequest
from tests.conftest import adapter_dir
from tests.unit.adapters.test_manager import _expected_delta


@pytest.fixture(scope="module")
def hf_config(tiny_model):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(tiny_model["model_dir"])


def _folded_manager(hf_config, tiny_model, max_loras: int = 16, max_moves: int = 8):
    """A manager whose projections are folded with random base weights (the in-GEMM shrink's layout), adapters 1-9
    read (ids 1-6 on the six test adapters, 7-9 on adapters 3-5)."""
    mgr = LoRAManager(hf_config, max_loras=max_loras, max_lora_rank=64, max_cpu_loras=16, device="cpu",
                      dtype=torch.float32)
    gen = torch.Generator().manual_seed(3)
    for proj in PROJ_MODULES:
        n, k = sum(mgr.shapes.slice_widths(proj)), mgr.shapes.proj_in(proj)
        mgr.pool.fold_base_weights(proj, [torch.randn(n, k, generator=gen) for _ in range(mgr.shapes.num_layers)])
    mgr.gemm_shrink_max_tokens = 64
    mgr.gemm_shrink_max_moves = max_moves
    paths = {}
    for adapter_id in range(1, 10):
        files = adapter_id - 1 if adapter_id <= 6 else adapter_id - 4  # 7-9: not the files of 1-3, which they swap with
        req = LoRARequest(f"a{adapter_id}", adapter_id, adapter_dir(tiny_model, files))
        mgr.validate_and_prefetch(req)
        paths[adapter_id] = req.lora_path
    return mgr, paths


def _check_deltas(mgr: LoRAManager, paths: dict[int, str], adapter_ids: list[int]) -> None:
    """Each adapter's delta, read from the slot it now holds, is the PEFT math of its own files."""
    ids = torch.tensor(adapter_ids, dtype=torch.int64)
    step = mgr.prepare_step(ids)
    gen = torch.Generator().manual_seed(0)
    for proj in ("qkv", "down"):
        widths = mgr.shapes.slice_widths(proj)
        x = torch.randn(len(ids), mgr.shapes.proj_in(proj), generator=gen)
        for layer in range(mgr.shapes.num_layers):
            out = torch.zeros(len(ids), sum(widths))
            step.add(layer, proj, x, out)
            for t, adapter_id in enumerate(adapter_ids):
                want = _expected_delta(paths[adapter_id], layer, proj, x[t:t + 1], widths)[0]
                torch.testing.assert_close(out[t], want, rtol=1e-5, atol=1e-5)


def test_a_decode_step_swaps_its_high_adapters_into_the_first_slots(hf_config, tiny_model):
    mgr, paths = _folded_manager(hf_config, tiny_model)
    assert mgr.assign_slots(range(1, 7)) == {i: i - 1 for i in range(1, 7)}  # lowest free slots first
    mgr.assign_slots([4, 5, 6])  # 1-3 are now the least recently used
    # three adapters on slots 6-8: without moves no width fits (the narrowest above slot 8 is 16, which 3 do not fill
    # half of); a 4-token decode step can use width 4 once they sit below it
    assert mgr.gemm_shrink_width(4, [6, 7, 8]) is None
    slot_of = mgr.assign_slots([7, 8, 9], decode_tokens=4)
    assert sorted(slot_of.values()) == [0, 1, 2] and mgr.num_slot_moves == 3
    assert {a: mgr._slot_of[a] for a in (1, 2, 3)} == {1: 6, 2: 7, 3: 8}  # swapped up, still resident
    assert mgr.num_evictions == 0 and mgr.gemm_shrink_width(4, slot_of.values()) == 4
    _check_deltas(mgr, paths, [7, 8, 9, 1, 2, 3, 4, 5, 6])
    # steps that are not decode steps, or whose adapters could not fill half of a width, move nothing
    mgr.assign_slots([1, 2, 3])
    mgr.assign_slots([1], decode_tokens=4)  # one adapter fills no width (4 at the least) half
    mgr.assign_slots([1, 2, 3, 7, 8, 9], decode_tokens=2)  # widths <= 2 x rows: none holds six
    assert mgr.num_slot_moves == 3


def test_a_free_slot_below_the_width_takes_the_move(hf_config, tiny_model):
    mgr, paths = _folded_manager(hf_config, tiny_model)
    mgr.assign_slots(range(1, 10))  # slots 0-8
    mgr.remove_adapter(4)  # frees slot 3
    slot_of = mgr.assign_slots([1, 2, 9], decode_tokens=4)  # 9 (slot 8) moves to the free slot 3, not swapped
    assert slot_of == {1: 0, 2: 1, 9: 3} and mgr.num_slot_moves == 1
    assert 8 in mgr._free_slots and 3 not in mgr._free_slots
    assert int(mgr.pool.ranks[:, :, 8].abs().sum()) == 0  # the old copy is cleared like any freed slot
    _check_deltas(mgr, paths, [9, 1, 2, 5, 6, 7, 8])


def test_moves_per_step_are_bounded(hf_config, tiny_model):
    mgr, paths = _folded_manager(hf_config, tiny_model, max_moves=1)
    mgr.assign_slots(range(1, 7))
    slot_of = mgr.assign_slots([7, 8, 9], decode_tokens=4)
    assert mgr.num_slot_moves == 1 and sorted(slot_of.values()) == [0, 7, 8]
    slot_of = mgr.assign_slots([7, 8, 9], decode_tokens=4)  # the next steps move the rest
    slot_of = mgr.assign_slots([7, 8, 9], decode_tokens=4)
    assert mgr.num_slot_moves == 3 and max(slot_of.values()) < 4
    _check_deltas(mgr, paths, list(range(1, 10)))
    mgr.gemm_shrink_max_moves = 0  # off: nothing moves
    mgr.assign_slots([4, 5, 6], decode_tokens=4)
    assert mgr.num_slot_moves == 3
