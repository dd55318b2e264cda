"""One compiled variant per LoRA launch configuration, whatever the step's token count.

Triton compiles a kernel again for every new specialization of its arguments: an integer's value class (== 1,
divisible by 16, other) unless the kernel lists it in ``do_not_specialize``, and a pointer's 16-byte alignment.
Token counts change every eager step, so an argument that follows them would compile a new variant inside
serving (seconds each, on a live engine). These tests record the launches of the LoRA kernels (without running
them) for many token counts and check that, per configuration (the constexprs and launch options), the
specialization is always the same."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # also set by conftest; kept here so this module runs alone

import pytest
import torch

from loraplex.adapters.mapping import LoRAStep
from loraplex.adapters.modules import PROJ_MODULES, BaseShapes
from loraplex.adapters.slot_pool import SlotPool
from loraplex.kernels import lora_expand, lora_meta, lora_shrink

SHAPES = BaseShapes(num_layers=3, hidden_size=64, q_size=64, kv_size=32, intermediate_size=160)
TOKEN_COUNTS = [1, 2, 3, 5, 15, 16, 17, 31, 33, 48, 63, 64, 65, 97, 128, 130, 200, 255, 256, 300]


class _Recorder:
    """Stands in for a Triton kernel: ``kernel[grid](*args, **kwargs)`` records the launch's specialization."""

    def __init__(self, kernel, unspecialized: tuple[str, ...], launches: list):
        self.arg_names = kernel.arg_names
        self.unspecialized = set(unspecialized)
        self.launches = launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            spec = []
            for name, value in zip(self.arg_names, args):
                if isinstance(value, torch.Tensor):
                    spec.append((name, value.data_ptr() % 16 == 0))
                elif isinstance(value, int) and not isinstance(value, bool) and name not in self.unspecialized:
                    spec.append((name, value == 1, value % 16 == 0))
            config = tuple(sorted((k, v) for k, v in kwargs.items() if not isinstance(v, torch.Tensor)))
            self.launches.append((config, tuple(spec)))
        return launch


def _variants(launches: list) -> dict:
    by_config: dict = {}
    for config, spec in launches:
        by_config.setdefault(config, set()).add(spec)
    return by_config


def _assert_one_variant_each(launches: list) -> None:
    assert launches
    for config, specs in _variants(launches).items():
        if len(specs) > 1:
            differing = {entry for spec in specs for entry in spec} - set.intersection(*(set(s) for s in specs))
            pytest.fail(f"{len(specs)} variants of one configuration {config}: differ in {sorted(differing)}")


@pytest.fixture
def recorded(monkeypatch):
    launches = {"shrink": [], "expand": [], "meta": []}
    monkeypatch.setattr(lora_shrink, "_lora_shrink_kernel",
                        _Recorder(lora_shrink._lora_shrink_kernel, lora_shrink.UNSPECIALIZED, launches["shrink"]))
    monkeypatch.setattr(lora_expand, "_lora_expand_kernel",
                        _Recorder(lora_expand._lora_expand_kernel, lora_expand.UNSPECIALIZED, launches["expand"]))
    monkeypatch.setattr(lora_meta, "_lora_meta_kernel",
                        _Recorder(lora_meta._lora_meta_kernel, lora_meta.UNSPECIALIZED, launches["meta"]))
    return launches


@pytest.mark.parametrize("num_active", [1, 3, 8])
def test_shrink_and_expand_compile_once_per_configuration(recorded, num_active):
    pool = SlotPool(SHAPES, max_loras=8, max_rank=16, device="cpu", dtype=torch.float32)
    pool.ranks.fill_(16)
    gen = torch.Generator().manual_seed(num_active)
    for num_tokens in TOKEN_COUNTS:
        slots = torch.randint(0, num_active, (num_tokens,), generator=gen, dtype=torch.int32)
        step = LoRAStep(pool, slots, min(num_active, num_tokens), use_triton=True)
        for proj in PROJ_MODULES:
            x = torch.zeros(num_tokens, SHAPES.proj_in(proj))
            out = torch.zeros(num_tokens, sum(SHAPES.slice_widths(proj)))
            for layer in range(SHAPES.num_layers):
                step.add(layer, proj, x, out)
    _assert_one_variant_each(recorded["shrink"])
    _assert_one_variant_each(recorded["expand"])


def test_meta_builder_compiles_once_per_block_size_and_its_tables_are_aligned(recorded):
    gen = torch.Generator().manual_seed(0)
    for num_slots in (8, 256):
        for num_tokens in TOKEN_COUNTS:
            slots = torch.randint(-1, 8, (num_tokens,), generator=gen, dtype=torch.int32)
            meta = lora_meta._build_lora_meta_kernel(slots, num_slots, 16)
            for table in (meta.sorted_token_ids, meta.chunk_slots, meta.chunk_starts, meta.chunk_lens,
                          meta.num_chunks, meta.chunk_tokens):
                assert table.data_ptr() % 16 == 0, (num_tokens, num_slots)
    _assert_one_variant_each(recorded["meta"])
