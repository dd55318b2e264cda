"""Which adapter a request uses (vLLM-compatible). Pure Python."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """``lora_name`` is a display name; ``lora_int_id`` (>= 1) identifies the adapter in the engine
    (slot pool, host cache, prefix-cache keys); ``lora_path`` is a PEFT directory."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be >= 1 (0 means the base model), got {self.lora_int_id}")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id
