"""Validated files shared across adapter ids: one read per unchanged file, a changed file read again."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraplex.adapters import AdapterError
from loraplex.adapters.manager import LoRAManager
from loraplex.engine.lora_request import LoRARequest
from tests.conftest import adapter_dir

WEIGHTS = "adapter_model.safetensors"


@pytest.fixture(scope="module")
def hf_config(tiny_model):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(tiny_model["model_dir"])


def _manager(hf_config, max_loras=4, max_cpu_loras=8) -> LoRAManager:
    return LoRAManager(hf_config, max_loras=max_loras, max_lora_rank=64, max_cpu_loras=max_cpu_loras,
                       device="cpu", dtype=torch.float32)


def _rewrite(path: Path, scale: float | None = None, nan: bool = False) -> None:
    """Rewrite the weights file in place (lora_B times ``scale``, or one NaN) with a later mtime."""
    weights = path / WEIGHTS
    before = os.stat(weights).st_mtime_ns
    tensors = load_file(str(weights))
    name = sorted(tensors)[0]
    if scale is not None:
        tensors = {k: v * scale if ".lora_B." in k else v for k, v in tensors.items()}
    if nan:
        tensors[name][0, 0] = float("nan")
    save_file(tensors, str(weights))
    later = before + 10**9  # explicit: coarse file-system timestamps must not hide the change
    os.utime(weights, ns=(later, later))


def test_ids_naming_one_directory_read_and_validate_it_once(tiny_model, hf_config):
    mgr = _manager(hf_config)
    path = adapter_dir(tiny_model, 1)
    for adapter_id in (1, 2, 3):
        mgr.validate_and_prefetch(LoRARequest(f"t{adapter_id}", adapter_id, path))
    assert mgr.num_host_loads == 1 and mgr.num_host_reuses == 2
    other = adapter_dir(tiny_model, 2)
    mgr.validate_and_prefetch(LoRARequest("other", 4, other))
    assert mgr.num_host_loads == 2  # another directory is its own read
    x = torch.randn(1, mgr.shapes.hidden_size, generator=torch.Generator().manual_seed(0))
    x = x.expand(4, -1).contiguous()
    out = mgr.prepare_step(torch.tensor([1, 2, 3, 4])).add(
        0, "qkv", x, torch.zeros(4, sum(mgr.shapes.slice_widths("qkv"))))
    assert torch.equal(out[0], out[1]) and torch.equal(out[0], out[2])  # same files, same delta
    assert out[0].abs().sum() > 0 and not torch.equal(out[0], out[3])
    assert mgr.num_loads == 4  # every id still gets its own slot


def test_changed_file_is_validated_again(tiny_model, hf_config, tmp_path):
    path = tmp_path / "a"
    shutil.copytree(adapter_dir(tiny_model, 1), path)
    mgr = _manager(hf_config)
    mgr.validate_and_prefetch(LoRARequest("v1", 1, str(path)))
    x = torch.randn(2, mgr.shapes.hidden_size, generator=torch.Generator().manual_seed(0))
    x[1] = x[0]
    width = sum(mgr.shapes.slice_widths("qkv"))

    _rewrite(path, scale=2.0)
    mgr.validate_and_prefetch(LoRARequest("v2", 2, str(path)))
    assert mgr.num_host_loads == 2 and mgr.num_host_reuses == 0
    out = mgr.prepare_step(torch.tensor([1, 2])).add(0, "qkv", x, torch.zeros(2, width))
    torch.testing.assert_close(out[1], 2 * out[0], rtol=1e-5, atol=1e-6)  # id 2 got the new values

    _rewrite(path, nan=True)
    for adapter_id in (3, 4):  # a failed validation is not remembered as valid
        with pytest.raises(AdapterError, match="NaN"):
            mgr.validate_and_prefetch(LoRARequest(f"bad{adapter_id}", adapter_id, str(path)))
    assert mgr.num_host_loads == 2
    out = mgr.prepare_step(torch.tensor([1, 2])).add(0, "qkv", x, torch.zeros(2, width))
    assert torch.isfinite(out).all()  # ids validated before the change keep serving


def test_removed_adapter_frees_its_slot_without_an_eviction(tiny_model, hf_config):
    mgr = _manager(hf_config, max_loras=2, max_cpu_loras=4)
    for i in range(3):
        mgr.validate_and_prefetch(LoRARequest(f"a{i}", i + 1, adapter_dir(tiny_model, i)))
    mgr.assign_slots([1, 2])
    mgr.remove_adapter(1)
    slot_of = mgr.assign_slots([3])
    assert sorted(mgr.resident_adapter_ids()) == [2, 3] and mgr.num_evictions == 0
    assert slot_of == {3: 0} and mgr.num_loads == 3
