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
