"""Adapter validation: every problem is refused with a message naming the file, tensor or field and limit."""

from __future__ import annotations

import builtins
import gzip
import io
import json
import math
import pickle
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraplex.adapters import AdapterError, validate_adapter_dir
from tests.conftest import adapter_dir

Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
Q_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


@pytest.fixture(scope="module")
def base_config(tiny_model):
    return json.loads((Path(tiny_model["model_dir"]) / "config.json").read_text())


@pytest.fixture
def adapter(tiny_model, tmp_path) -> Path:
    """A writable copy of adapter-0 (rank 8, all seven modules)."""
    dst = tmp_path / "adapter"
    shutil.copytree(adapter_dir(tiny_model, 0), dst)
    return dst


def _edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "adapter_config.json").read_text())
    cfg.update(changes)
    (path / "adapter_config.json").write_text(json.dumps(cfg))


def _edit_tensors(path: Path, fn) -> None:
    tensors = load_file(str(path / "adapter_model.safetensors"))
    fn(tensors)
    save_file(tensors, str(path / "adapter_model.safetensors"))


def _raw_safetensors(path: Path, header: bytes, claimed_len: int | None = None) -> None:
    n = len(header) if claimed_len is None else claimed_len
    (path / "adapter_model.safetensors").write_bytes(struct.pack("<Q", n) + header)


def test_valid_adapters_and_their_spec(tiny_model, base_config):
    for i, info in enumerate(tiny_model["adapters"]):
        spec = validate_adapter_dir(adapter_dir(tiny_model, i), base_config, max_rank=64)
        assert spec.rank == info["rank"]
        assert set(spec.target_modules) == set(info["target_modules"])
        assert spec.scaling == pytest.approx(2.0)  # the demo writes lora_alpha = 2 r
        assert spec.dtype == "F32"


def test_rslora_and_alpha_scaling(adapter, base_config):
    _edit_config(adapter, lora_alpha=32, use_rslora=True)
    assert validate_adapter_dir(adapter, base_config, 64).scaling == pytest.approx(32 / math.sqrt(8))
    _edit_config(adapter, lora_alpha=4, use_rslora=False)
    assert validate_adapter_dir(adapter, base_config, 64).scaling == pytest.approx(0.5)


def test_pickle_file_refused_without_being_opened(adapter, base_config, monkeypatch):
    (adapter / "adapter_model.bin").write_bytes(b"\x80\x04not really a pickle")
    real_open = builtins.open

    def guarded_open(file, *args, **kwargs):
        assert not str(file).endswith(".bin"), "the pickle file was opened"
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", guarded_open)
    with pytest.raises(AdapterError, match="pickle") as err:
        validate_adapter_dir(adapter, base_config, 64)
    assert err.value.file == "adapter_model.bin"


def test_rank_over_limit_names_the_limit(adapter, base_config):
    with pytest.raises(AdapterError, match="max_lora_rank") as err:
        validate_adapter_dir(adapter, base_config, max_rank=4)
    assert err.value.field == "r" and err.value.limit == 4 and err.value.file == "adapter_config.json"


@pytest.mark.parametrize("changes, field", [
    ({"bias": "all"}, "bias"),
    ({"use_dora": True}, "use_dora"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"target_modules": ["q_proj", "lm_head"]}, "target_modules"),
    ({"target_modules": ".*proj"}, "target_modules"),
    ({"auto_map": {"AutoModel": "evil.Model"}}, "auto_map"),
    ({"peft_type": "IA3"}, "peft_type"),
    ({"lora_alpha": -1}, "lora_alpha"),
    ({"r": "8"}, "r"),
    ({"rank_pattern": {"q_proj": 4}}, "rank_pattern"),
    # options that make PEFT compute something other than plain LoRA: the engine must not pretend
    ({"use_qalora": True}, "use_qalora"),
    ({"alora_invocation_tokens": [5, 6]}, "alora_invocation_tokens"),
    ({"arrow_config": {"top_k": 2}}, "arrow_config"),
    ({"exclude_modules": ".*q_proj"}, "exclude_modules"),
    # PEFT's AutoPeftModel imports auto_mapping's parent_library: a module name is a code reference
    ({"auto_mapping": {"base_model_class": "Model", "parent_library": "evil"}}, "auto_mapping"),
    ({"megatron_core": "evil.core"}, "megatron_core"),
])
def test_config_problems_name_the_field(adapter, base_config, changes, field):
    _edit_config(adapter, **changes)
    with pytest.raises(AdapterError) as err:
        validate_adapter_dir(adapter, base_config, 64)
    assert err.value.field == field and field in str(err.value)


def test_target_module_without_weights_in_config_is_refused(adapter, base_config):
    _edit_config(adapter, target_modules=["q_proj", "v_proj"])  # weights exist for all seven
    with pytest.raises(AdapterError, match="not in target_modules") as err:
        validate_adapter_dir(adapter, base_config, 64)
    assert err.value.tensor.split(".")[-3] not in ("q_proj", "v_proj")


def test_config_not_json_or_too_big(adapter, base_config):
    (adapter / "adapter_config.json").write_text("{not json")
    with pytest.raises(AdapterError, match="not valid JSON"):
        validate_adapter_dir(adapter, base_config, 64)
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "pad": "x" * 70_000}))
    with pytest.raises(AdapterError, match="over the cap") as err:
        validate_adapter_dir(adapter, base_config, 64)
    assert err.value.limit == 64 << 10


@pytest.mark.parametrize("mutate, match", [
    (lambda t: t.update({Q_A: t[Q_A][:, :-1].contiguous()}), "does not match the base model"),
    (lambda t: t.update({Q_B: t[Q_B].double()}), "F64"),
    (lambda t: t[Q_A].__setitem__((0, 0), float("nan")), "NaN"),
    (lambda t: t[Q_B].__setitem__((1, 1), float("inf")), "NaN or Inf"),
    (lambda t: t.pop(Q_B), "no lora_B"),
    (lambda t: t.update({"base_model.model.model.layers.0.self_attn.q_proj.bias": torch.ones(64)}),
     "unexpected tensor"),
    (lambda t: t.update({Q_A.replace("layers.0", "layers.9"): t[Q_A].clone()}), "does not exist"),
])
def test_tensor_problems_name_the_tensor(adapter, base_config, mutate, match):
    _edit_tensors(adapter, mutate)
    with pytest.raises(AdapterError, match=match) as err:
        validate_adapter_dir(adapter, base_config, 64)
    assert err.value.tensor and err.value.file == "adapter_model.safetensors"


def test_huge_header_claim_refused_before_reading(adapter, base_config):
    _raw_safetensors(adapter, b"{}", claimed_len=100_000_000)
    with pytest.raises(AdapterError, match="header claims 100000000 bytes") as err:
        validate_adapter_dir(adapter, base_config, 64)
    assert err.value.limit == 1 << 20


def _torch_zip(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


@pytest.mark.parametrize("content, match", [
    (lambda t: pickle.dumps({k: v.tolist() for k, v in list(t.items())[:2]}), "a Python pickle"),
    (lambda t: _torch_zip(t), "a zip file, as torch.save writes"),
    (lambda t: gzip.compress(b"x" * 4096, mtime=0), "gzip-compressed"),
], ids=["pickle", "torch.save zip", "gzip"])
def test_other_formats_as_weights_are_named_not_parsed(adapter, base_config, content, match):
    """A pickle or a torch.save file uploaded as the weights: told by its first bytes, before anything is parsed
    (never unpickled), and named, instead of "header claims N bytes, over the cap"."""
    path = adapter / "adapter_model.safetensors"
    path.write_bytes(content(load_file(str(path))))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pickle, "loads", lambda *a, **k: pytest.fail("unpickled"))
        mp.setattr(pickle, "load", lambda *a, **k: pytest.fail("unpickled"))
        with pytest.raises(AdapterError, match="^not a safetensors file: it is ") as err:
            validate_adapter_dir(adapter, base_config, 64)
    assert match in str(err.value) and err.value.file == "adapter_model.safetensors"


def test_a_real_header_whose_length_opens_like_a_pickle_is_still_read(adapter, base_config):
    """0x10280 bytes of header start with 80 02, a pickle's first two bytes: the length is possible, so it is read."""
    path = adapter / "adapter_model.safetensors"
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header, data = raw[8:8 + n], raw[8 + n:]
    padded = header + b" " * (0x10280 - n)
    path.write_bytes(struct.pack("<Q", len(padded)) + padded + data)
    assert path.read_bytes()[:2] == b"\x80\x02"
    spec = validate_adapter_dir(adapter, base_config, 64)
    assert spec.rank == 8


# "data\u005foffsets" is "data_offsets" once parsed: the byte count before parsing misses it, the count after not
@pytest.mark.parametrize("offsets_key", ["data_offsets", "data\\u005foffsets"], ids=["plain", "escaped"])
def test_too_many_entries_refused(adapter, base_config, offsets_key):
    entries = (f'"t{i}": {{"dtype": "F32", "shape": [0], "{offsets_key}": [0, 0]}}' for i in range(300))
    header = ("{" + ", ".join(entries) + "}").encode()
    _raw_safetensors(adapter, header)
    with pytest.raises(AdapterError, match="300 entries") as err:
        validate_adapter_dir(adapter, base_config, 64)
    assert err.value.limit == 2 * 7 * base_config["num_hidden_layers"] + 64


@pytest.mark.parametrize("changes", [{"lora_alpha": 1e30}, {"lora_alpha": 1e6, "r": 8},
                                     {"lora_alpha": 40_000, "r": 16, "use_rslora": True}])
def test_scaling_over_the_cap_is_refused(adapter, base_config, changes):
    """alpha / r (or / sqrt(r)) that overflows the activations: the tenant's own outputs would be NaN."""
    from loraplex.adapters.config_check import MAX_SCALING

    _edit_config(adapter, **changes)
    with pytest.raises(AdapterError, match="scaling") as err:
        validate_adapter_dir(adapter, base_config, 64)
    assert err.value.field == "lora_alpha" and err.value.limit == MAX_SCALING


@pytest.mark.parametrize("header", [
    b"[1, 2]",
    b'{"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 999]}}',
    b'{"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}, "a": {}}',
    b"\xff\xfe",
])
def test_malformed_headers(adapter, base_config, header):
    _raw_safetensors(adapter, header)
    with pytest.raises(AdapterError) as err:
        validate_adapter_dir(adapter, base_config, 64)
    assert err.value.file == "adapter_model.safetensors"


def test_missing_files(adapter, base_config, tmp_path):
    (adapter / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterError, match="missing adapter_model.safetensors"):
        validate_adapter_dir(adapter, base_config, 64)
    with pytest.raises(AdapterError, match="not a directory"):
        validate_adapter_dir(tmp_path / "nope", base_config, 64)


@pytest.mark.parametrize("dtype", [["F32"], {"F32": 1}])
def test_a_dtype_that_is_not_a_string_is_an_adapter_error(adapter, base_config, dtype):
    """A JSON list or object as dtype used to escape as a TypeError (a 500 on upload)."""
    header = json.dumps({"a": {"dtype": dtype, "shape": [1], "data_offsets": [0, 4]}}).encode()
    (adapter / "adapter_model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 4)
    with pytest.raises(AdapterError, match="unknown dtype") as err:
        validate_adapter_dir(adapter, base_config, 64)
    assert err.value.tensor == "a"


def test_weights_outside_layers_to_transform_or_of_excluded_modules_are_refused(adapter, base_config):
    """PEFT gives LoRA only to the listed layers and never to excluded modules (other weights are dropped on
    load), so such weights would make the engine compute something PEFT does not."""
    layers = base_config["num_hidden_layers"]
    _edit_config(adapter, layers_to_transform=[0])
    with pytest.raises(AdapterError, match="not in layers_to_transform") as err:
        validate_adapter_dir(adapter, base_config, 64)
    assert ".layers.1." in err.value.tensor
    _edit_config(adapter, layers_to_transform=[layers])
    with pytest.raises(AdapterError, match="does not exist") as err:
        validate_adapter_dir(adapter, base_config, 64)
    assert err.value.field == "layers_to_transform" and err.value.limit == f"{layers} layers"
    _edit_config(adapter, layers_to_transform=list(range(layers)))
    assert validate_adapter_dir(adapter, base_config, 64).rank == 8
    _edit_config(adapter, layers_to_transform=None, exclude_modules=["lm_head", "model.layers.0.mlp.up_proj"])
    with pytest.raises(AdapterError, match="exclude_modules") as err:
        validate_adapter_dir(adapter, base_config, 64)
    assert ".up_proj." in err.value.tensor
    _edit_config(adapter, exclude_modules=["lm_head"])  # excludes nothing that carries weights
    assert validate_adapter_dir(adapter, base_config, 64).rank == 8


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_all_finite_reads_nan_and_inf_from_the_bits(dtype):
    from loraplex.adapters.validate import all_finite

    info = torch.finfo(dtype)
    edge = torch.tensor([info.max, -info.max, info.tiny, -info.tiny, info.tiny / 4, 0.0, -0.0, 1.0], dtype=dtype)
    assert all_finite(edge)  # the largest, smallest normal and subnormal values are finite
    for bad in (float("nan"), float("inf"), float("-inf"), -float("nan")):
        t = torch.randn(64, 33).to(dtype)
        t[17, 5] = bad
        assert not all_finite(t), bad
        assert not all_finite(t.t())  # a non-contiguous view too
    wide = torch.randn(2, 300).to(dtype)
    assert all_finite(wide) == bool(torch.isfinite(wide).all())
    assert all_finite(torch.empty(0, 4, dtype=dtype))
