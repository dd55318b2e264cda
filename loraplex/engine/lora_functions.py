"""vLLM's ``LLMEngine`` LoRA methods (``llm.llm_engine.add_lora`` ...), mapped onto the adapter manager.

vLLM's meaning, and Loraplex's:
- ``add_lora(lora_request) -> bool``: read and validate the adapter now (host memory), registering its id for
  later requests; True. A bad adapter is an ``AdapterError`` (a ValueError naming the file), an id registered
  for another directory too.
- ``remove_lora(lora_id) -> bool``: forget the adapter (host copy, GPU slot, prefix-cache blocks computed with
  it; once no running request uses it); False, as in vLLM, for an id the engine does not know.
- ``list_loras() -> set[int]``: the adapters whose weights the engine holds (host memory or a GPU slot), as
  vLLM lists its CPU cache; ids whose files are the same share one host copy, so fewer are evicted than in vLLM.
- ``pin_lora(lora_id) -> bool``: keep the adapter in a GPU slot (and in host memory) until it is removed; True.
  A ValueError for an id not registered, and for a pin that would leave no slot of ``max_loras`` to the other
  adapters (the scheduler then admits the others within the slots the pinned ones leave).
All four are a ValueError naming ``enable_lora`` on an engine started without it. Under tensor parallelism
``add_lora`` and ``pin_lora`` reach every rank: each reads its shard of the adapter then (so its files may go once
``add_lora`` has returned, as in vLLM) and holds the pinned one in a slot; rank 0's scheduler leaves room for the
pinned ones on every rank. An adapter named only by requests is read by the other ranks at the first step that
uses it.
"""

from __future__ import annotations

import numbers

from loraplex.engine.lora_request import LoRARequest


def _check_id(name: str, lora_id) -> int:
    if not isinstance(lora_id, numbers.Integral) or isinstance(lora_id, bool):
        raise TypeError(f"{name}: lora_id must be an integer (a LoRARequest's lora_int_id), got "
                        f"{type(lora_id).__name__} {lora_id!r}")
    return int(lora_id)


class LoRAFunctions:
    """Mixed into ``LLMEngine`` (uses its ``config``, ``runner``, ``scheduler``, ``tp_driver`` and ``remove_adapter``)."""

    def _lora_manager(self, method: str):
        if not self.config.enable_lora:
            raise ValueError(f"{method}: this engine was started without enable_lora; start it with "
                             "enable_lora=True to use adapters")
        manager = self.runner.get_lora_manager()
        if self.scheduler.adapters is None:
            self.scheduler.adapters = manager
        return manager

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read and validate an adapter now, so the first request using it does not wait for the read."""
        if not isinstance(lora_request, LoRARequest):
            raise TypeError(f"add_lora: lora_request must be a LoRARequest, got {type(lora_request).__name__} "
                            f"{lora_request!r:.80}")
        self._lora_manager("add_lora").validate_and_prefetch(lora_request)
        if self.tp_driver is not None:
            self.tp_driver.add_adapter(lora_request)
        return True

    def remove_lora(self, lora_id: int) -> bool:
        """Forget an adapter (see ``remove_adapter``); False for an id the engine does not know."""
        lora_id = _check_id("remove_lora", lora_id)
        manager = self._lora_manager("remove_lora")
        if not (manager.is_registered(lora_id) or lora_id in manager.loaded_adapter_ids()):
            return False
        self.remove_adapter(lora_id)
        return True

    def list_loras(self) -> set[int]:
        return self._lora_manager("list_loras").loaded_adapter_ids()

    def pin_lora(self, lora_id: int) -> bool:
        """Keep a registered adapter in a GPU slot until ``remove_lora``."""
        lora_id = _check_id("pin_lora", lora_id)
        manager = self._lora_manager("pin_lora")
        try:
            manager.keep_resident(lora_id)
        except ValueError as exc:
            raise ValueError(f"pin_lora: {exc}") from exc
        if self.tp_driver is not None:
            name, path = manager.registration(lora_id)
            self.tp_driver.keep_adapter(LoRARequest(name, lora_id, path))
        return True
