"""``LoRARequest`` refuses what cannot name an adapter, with the field in the message."""

from __future__ import annotations

from pathlib import Path

import pytest

from loraplex import LoRARequest


@pytest.mark.parametrize("kwargs, field", [
    ({"lora_int_id": "3"}, "lora_int_id"),  # was TypeError: '<' not supported between 'str' and 'int'
    ({"lora_int_id": 2.0}, "lora_int_id"),
    ({"lora_int_id": True}, "lora_int_id"),  # True == 1: it would have run as adapter 1
    ({"lora_int_id": 0}, "lora_int_id"),
    ({"lora_name": None}, "lora_name"),
    ({"lora_path": None}, "lora_path"),  # was accepted; the read then failed as the directory "None"
    ({"lora_path": ""}, "lora_path"),
])
def test_bad_fields_are_value_errors_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}: "):
        LoRARequest(**{"lora_name": "a", "lora_int_id": 1, "lora_path": "/adapters/a", **kwargs})


def test_numpy_ids_and_path_objects_are_accepted():
    np = pytest.importorskip("numpy")
    req = LoRARequest("a", np.int64(7), Path("/adapters/a"))
    assert req.lora_int_id == 7 and type(req.lora_int_id) is int and req.adapter_id == 7


def test_vllm_optional_fields_are_accepted():
    req = LoRARequest("a", 1, "/adapters/a", base_model_name="meta-llama/Llama-3-8B")
    assert req.base_model_name == "meta-llama/Llama-3-8B"
    assert (req.name, req.path, req.adapter_id) == ("a", "/adapters/a", 1)
    assert LoRARequest("a", 1, "/adapters/a").base_model_name is None


def test_lora_local_path_is_a_deprecated_spelling_of_lora_path():
    with pytest.warns(DeprecationWarning, match="lora_path"):
        req = LoRARequest("a", 1, lora_local_path="/adapters/a")
    assert req.lora_path == "/adapters/a" and req == LoRARequest("a", 1, "/adapters/a")
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="^lora_local_path: .*another directory"):
        LoRARequest("a", 1, "/adapters/a", lora_local_path="/adapters/b")


@pytest.mark.parametrize("kwargs, field, needle", [
    ({"long_lora_max_len": 4096}, "long_lora_max_len", "not supported"),
    ({"tensorizer_config_dict": {"tensorizer_dir": "/t"}}, "tensorizer_config_dict", "PEFT directory"),
    ({"base_model_name": 3}, "base_model_name", "string"),
])
def test_vllm_fields_loraplex_cannot_honour_are_refused(kwargs, field, needle):
    with pytest.raises(ValueError, match=f"^{field}: .*{needle}"):
        LoRARequest("a", 1, "/adapters/a", **kwargs)
    LoRARequest("a", 1, "/adapters/a", **dict.fromkeys(kwargs))  # None: vLLM's default, accepted
