"""Which adapter a request uses (vLLM-compatible). Pure Python."""

from __future__ import annotations

import numbers
import os
import warnings
from dataclasses import InitVar, dataclass, field


@dataclass(frozen=True)
class LoRARequest:
    """``lora_name`` is a display name; ``lora_int_id`` (>= 1) identifies the adapter in the engine
    (slot pool, host cache, prefix-cache keys); ``lora_path`` is a PEFT directory.

    vLLM's other fields, by keyword: ``base_model_name`` is kept as given (an engine serves one base model, so
    it selects nothing); ``lora_local_path`` is older vLLM's deprecated spelling of ``lora_path`` (a
    DeprecationWarning); ``long_lora_max_len`` and ``tensorizer_config_dict`` ask for what Loraplex cannot do
    (long-context LoRA, tensorizer-serialized adapters) and are refused unless None."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = field(default=None, kw_only=True)
    lora_local_path: InitVar[str | None] = field(default=None, kw_only=True)
    long_lora_max_len: InitVar[int | None] = field(default=None, kw_only=True)
    tensorizer_config_dict: InitVar[dict | None] = field(default=None, kw_only=True)

    def __post_init__(self, lora_local_path, long_lora_max_len, tensorizer_config_dict) -> None:
        # refused here, not in the engine's step: a request with a bad field must never be queued
        if not isinstance(self.lora_name, str):
            raise ValueError(f"lora_name: must be a string, got {self.lora_name!r}")
        if not isinstance(self.lora_int_id, numbers.Integral) or isinstance(self.lora_int_id, bool):
            raise ValueError(f"lora_int_id: must be an integer, got {self.lora_int_id!r}")
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id: must be >= 1 (0 means the base model), got {self.lora_int_id}")
        if lora_local_path is not None:
            warnings.warn("lora_local_path is deprecated (as in vLLM); pass the directory as lora_path",
                          DeprecationWarning, stacklevel=3)
            if self.lora_path and os.fspath(self.lora_path) != os.fspath(lora_local_path):
                raise ValueError(f"lora_local_path: names another directory than lora_path ({lora_local_path!r} "
                                 f"and {self.lora_path!r}); pass lora_path alone")
            object.__setattr__(self, "lora_path", lora_local_path)
        if not isinstance(self.lora_path, (str, os.PathLike)) or not str(self.lora_path):
            raise ValueError(f"lora_path: must be a non-empty path (a PEFT adapter directory), got "
                             f"{self.lora_path!r}")
        if self.base_model_name is not None and not isinstance(self.base_model_name, str):
            raise ValueError(f"base_model_name: must be a string or None, got {self.base_model_name!r}")
        if long_lora_max_len is not None:
            raise ValueError(f"long_lora_max_len: long-context LoRA (scaled rotary embeddings per adapter) is not "
                             f"supported (newer vLLM dropped it too); leave it out, got {long_lora_max_len!r}")
        if tensorizer_config_dict is not None:
            raise ValueError("tensorizer_config_dict: tensorizer-serialized adapters are not supported; save the "
                             "adapter as a PEFT directory (adapter_config.json + adapter_model.safetensors)")
        object.__setattr__(self, "lora_int_id", int(self.lora_int_id))  # a numpy id hashes and prints as an int

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
