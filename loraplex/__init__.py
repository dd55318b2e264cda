"""Loraplex: multi-tenant LoRA adapter serving.

The offline API is vLLM-compatible::

    from loraplex import LLM, SamplingParams, LoRARequest
"""

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "LoRARequest", "__version__"]


def __getattr__(name: str):
    # lazy: importing loraplex (e.g. for the CLI or the platform) must not pull in torch
    if name == "LLM":
        from loraplex.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from loraplex.engine.sampling_params import SamplingParams

        return SamplingParams
    if name == "LoRARequest":
        from loraplex.engine.lora_request import LoRARequest

        return LoRARequest
    raise AttributeError(f"module 'loraplex' has no attribute {name!r}")
