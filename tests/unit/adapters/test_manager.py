"""LoRAManager on the CPU: exact PEFT math per token, slot eviction policy, pins, counters, bad adapters."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from loraplex.adapters import AdapterError
from loraplex.adapters.manager import LoRAManager
from loraplex.adapters.modules import PROJ_MODULES
from loraplex.engine.lora_request import LoRARequest
from tests.conftest import adapter_dir


@pytest.fixture(scope="module")
def hf_config(tiny_model):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(tiny_model["model_dir"])


def _req(tiny_model, i: int) -> LoRARequest:
    return LoRARequest(f"a{i}", i + 1, adapter_dir(tiny_model, i))


def _expected_delta(path: str, layer: int, proj: str, x: torch.Tensor, widths) -> torch.Tensor:
    """PEFT's lora_B(lora_A(x)) * scaling per slice, straight from the adapter files."""
    cfg = json.loads((Path(path) / "adapter_config.json").read_text())
    scaling = cfg["lora_alpha"] / cfg["r"]
    tensors = load_file(str(Path(path) / "adapter_model.safetensors"))
    parts = []
    for module, width in zip(PROJ_MODULES[proj], widths):
        parent = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
        prefix = f"base_model.model.model.layers.{layer}.{parent}.{module}"
        if f"{prefix}.lora_A.weight" in tensors:
            a, b = tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"]
            parts.append((x @ a.T @ b.T) * scaling)
        else:
            parts.append(torch.zeros(x.shape[0], width))
    return torch.cat(parts, dim=1)


def test_add_matches_peft_math_per_token(tiny_model, hf_config):
    mgr = LoRAManager(hf_config, max_loras=4, max_lora_rank=64, max_cpu_loras=6, device="cpu",
                      dtype=torch.float32)
    reqs = [_req(tiny_model, i) for i in range(4)]
    for r in reqs:
        mgr.validate_and_prefetch(r)
    ids = torch.tensor([0, 1, 2, 2, 0, 3, 4, 1, 4, 4], dtype=torch.int64)
    step = mgr.prepare_step(ids)
    gen = torch.Generator().manual_seed(0)
    for proj in PROJ_MODULES:
        widths = mgr.shapes.slice_widths(proj)
        x = torch.randn(len(ids), mgr.shapes.proj_in(proj), generator=gen)
        base = torch.randn(len(ids), sum(widths), generator=gen)
        for layer in range(mgr.shapes.num_layers):
            out = base.clone()
            step.add(layer, proj, x, out)
            for t, adapter_id in enumerate(ids.tolist()):
                if adapter_id == 0:
                    assert torch.equal(out[t], base[t])  # base-model rows untouched
                    continue
                want = base[t] + _expected_delta(reqs[adapter_id - 1].lora_path, layer, proj, x[t:t + 1],
                                                 widths)[0]
                torch.testing.assert_close(out[t], want, rtol=1e-5, atol=1e-5)
    assert mgr.num_loads == 4 and mgr.num_evictions == 0 and mgr.num_host_loads == 4


def test_more_adapters_than_slots_evicts_lru_but_never_pinned_or_in_step(tiny_model, hf_config):
    mgr = LoRAManager(hf_config, max_loras=2, max_lora_rank=64, max_cpu_loras=2, device="cpu",
                      dtype=torch.float32)
    for i in range(4):
        mgr.validate_and_prefetch(_req(tiny_model, i))
    assert mgr.num_host_loads == 4 and len(mgr.host_cache) == 2  # host LRU keeps the 2 most recent
    mgr.acquire(1)
    mgr.prepare_step(torch.tensor([1, 2]))
    assert sorted(mgr.resident_adapter_ids()) == [1, 2]
    assert mgr.num_host_loads == 6  # 1 and 2 had left the host cache: re-read from disk
    mgr.prepare_step(torch.tensor([3, 0]))  # 1 is pinned: 2 goes
    assert sorted(mgr.resident_adapter_ids()) == [1, 3] and mgr.num_evictions == 1
    assert not mgr.can_fit([2, 4])
    with pytest.raises(RuntimeError, match="max_loras"):
        mgr.prepare_step(torch.tensor([2, 4]))  # would need to evict pinned 1: the scheduler prevents this
    mgr.release(1)
    slot_of = mgr.assign_slots([0, 2, 4, 4])
    assert sorted(slot_of) == [2, 4] and sorted(slot_of.values()) == [0, 1]
    assert sorted(mgr.resident_adapter_ids()) == [2, 4]
    assert mgr.num_loads == 5 and mgr.num_evictions == 3


def test_remove_adapter_waits_for_last_user(tiny_model, hf_config):
    mgr = LoRAManager(hf_config, max_loras=2, max_lora_rank=64, max_cpu_loras=4, device="cpu",
                      dtype=torch.float32)
    mgr.validate_and_prefetch(_req(tiny_model, 0))
    mgr.acquire(1)
    mgr.prepare_step(torch.tensor([1]))
    mgr.remove_adapter(1)
    assert mgr.resident_adapter_ids() == [1]
    mgr.release(1)
    assert mgr.resident_adapter_ids() == [] and 1 not in mgr.host_cache
    # a request queued before the removal still runs while the files exist (re-read from disk)
    mgr.prepare_step(torch.tensor([1]))
    assert mgr.num_host_loads == 2
    # once removed, the id may come back with another path (a new version): the old weights go everywhere
    assert mgr.resident_adapter_ids() == [1]
    mgr.validate_and_prefetch(LoRARequest("a0-v2", 1, adapter_dir(tiny_model, 2)))
    assert mgr.host_cache.get(1).rank == tiny_model["adapters"][2]["rank"]
    assert mgr.resident_adapter_ids() == []
    with pytest.raises(KeyError):
        mgr.prepare_step(torch.tensor([9]))  # never prefetched


def test_bad_adapter_is_refused_and_others_keep_working(tiny_model, hf_config, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(adapter_dir(tiny_model, 5), bad)  # rank 64 > max_lora_rank 32
    mgr = LoRAManager(hf_config, max_loras=2, max_lora_rank=32, max_cpu_loras=4, device="cpu",
                      dtype=torch.float32)
    with pytest.raises(AdapterError, match="max_lora_rank"):
        mgr.validate_and_prefetch(LoRARequest("bad", 9, str(bad)))
    mgr.validate_and_prefetch(_req(tiny_model, 1))
    step = mgr.prepare_step(torch.tensor([2, 0]))
    x = torch.randn(2, mgr.shapes.hidden_size)
    out = torch.zeros(2, sum(mgr.shapes.slice_widths("qkv")))
    step.add(0, "qkv", x, out)
    assert out[0].abs().sum() > 0 and torch.equal(out[1], torch.zeros_like(out[1]))
    with pytest.raises(AdapterError, match="another path"):
        mgr.validate_and_prefetch(LoRARequest("other", 2, str(bad)))
    # the same directory spelled otherwise is the same adapter, not a clash
    d = adapter_dir(tiny_model, 1)
    link = tmp_path / "link"
    link.symlink_to(d)
    for spelling in (d + "/", f"{d}/../{os.path.basename(d)}", link, str(link)):
        mgr.validate_and_prefetch(LoRARequest("a1", 2, spelling))


def test_adapter_on_some_layers_only(tiny_model, hf_config, tmp_path):
    """PEFT's layers_to_transform: layers without tensors get no delta (rank 0 there, nothing read)."""
    from safetensors.torch import save_file

    partial = tmp_path / "partial"
    shutil.copytree(adapter_dir(tiny_model, 1), partial)  # rank 16 on q_proj, v_proj
    weights = partial / "adapter_model.safetensors"
    tensors = {k: v for k, v in load_file(str(weights)).items() if ".layers.0." in k}
    save_file(tensors, str(weights))
    cfg = json.loads((partial / "adapter_config.json").read_text())
    cfg["layers_to_transform"] = [0]
    (partial / "adapter_config.json").write_text(json.dumps(cfg))
    mgr = LoRAManager(hf_config, max_loras=2, max_lora_rank=64, max_cpu_loras=2, device="cpu",
                      dtype=torch.float32)
    adapter = mgr.validate_and_prefetch(LoRARequest("partial", 7, str(partial)))
    assert adapter.spec.module_layers == {"q_proj": (0,), "v_proj": (0,)}
    step = mgr.prepare_step(torch.tensor([7, 7]))
    x = torch.randn(2, mgr.shapes.hidden_size)
    widths = mgr.shapes.slice_widths("qkv")
    for layer in (0, 1):
        out = step.add(layer, "qkv", x, torch.zeros(2, sum(widths)))
        want = _expected_delta(str(partial), layer, "qkv", x, widths)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    assert out.abs().sum() == 0  # layer 1 has no tensors
