"""PEFT LoRA adapters: validation, host cache, GPU slot pool and the per-step LoRA batch.

``validate_adapter_dir`` and ``AdapterError`` import no torch-heavy engine code (the registry uses them);
``LoRAManager`` is imported from ``loraplex.adapters.manager``.
"""

from loraplex.adapters.errors import AdapterError
from loraplex.adapters.validate import AdapterSpec, validate_adapter_dir

__all__ = ["AdapterError", "AdapterSpec", "validate_adapter_dir"]
