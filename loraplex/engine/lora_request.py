"""Which adapter a request uses (vLLM-compatible). Pure Python."""

from __future__ import annotations

import numbers
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """``lora_name`` is a display name; ``lora_int_id`` (>= 1) identifies the adapter in the engine
    (slot pool, host cache, prefix-cache keys); ``lora_path`` is a PEFT directory."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        # refused here, not in the engine's step: a request with a bad field must never be queued
        if not isinstance(self.lora_name, str):
            raise ValueError(f"lora_name: must be a string, got {self.lora_name!r}")
        if not isinstance(self.lora_int_id, numbers.Integral) or isinstance(self.lora_int_id, bool):
            raise ValueError(f"lora_int_id: must be an integer, got {self.lora_int_id!r}")
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id: must be >= 1 (0 means the base model), got {self.lora_int_id}")
        if not isinstance(self.lora_path, (str, os.PathLike)) or not str(self.lora_path):
            raise ValueError(f"lora_path: must be a non-empty path (a PEFT adapter directory), got "
                             f"{self.lora_path!r}")
        object.__setattr__(self, "lora_int_id", int(self.lora_int_id))  # a numpy id hashes and prints as an int

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id
