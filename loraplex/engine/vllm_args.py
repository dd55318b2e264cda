"""``LLM(...)`` keywords that are vLLM's but not Loraplex's engine options: code written for vLLM's ``LLM`` passes
them, and each gets a clear answer instead of "EngineConfig.__init__() got an unexpected keyword argument".

- IGNORED: nothing to do here; vLLM's default value passes silently, another one with a warning saying why it
  changes nothing.
- UNSUPPORTED: a value other than vLLM's default would make Loraplex run something else than the caller asked for,
  so it is refused (ValueError naming ``LLM`` and the argument).
- Anything else that is not an EngineConfig field is a TypeError naming ``LLM`` and the argument, as Python's own.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging

from loraplex.engine.config import EngineConfig

log = logging.getLogger(__name__)

_LOCAL = "Loraplex loads a local model directory and downloads nothing"

# name: (the values vLLM takes by default, or that change nothing; why the argument changes nothing here)
IGNORED = {
    "trust_remote_code": ((False,), "Loraplex runs its own Llama-family model code, never code from a checkpoint"),
    "tokenizer_mode": (("auto", "hf"), "the tokenizer is AutoTokenizer's default (the fast one where there is one)"),
    "swap_space": ((4,), "there is no CPU swap space: a preempted request is recomputed"),
    "max_seq_len_to_capture": ((8192,), "CUDA graphs are captured per batch size (enforce_eager turns them off)"),
    "disable_custom_all_reduce": ((False, True), "tensor parallelism all-reduces through NCCL"),
    "disable_async_output_proc": ((False, True), "async_scheduling is the engine's own option"),
    "disable_log_stats": ((False, True), "the offline engine logs no periodic stats"),
    "enable_chunked_prefill": ((None, True), "prompts are always split into chunks by max_num_batched_tokens"),
    "distributed_executor_backend": ((None, "mp"), "tensor-parallel workers are always processes"),
    "load_format": (("auto", "safetensors"), "weights are always read from *.safetensors"),
    "download_dir": ((None,), _LOCAL),
    "hf_token": ((None,), _LOCAL),
    "fully_sharded_loras": ((False,), "tensor parallelism shards adapters one way, as S-LoRA does"),
}

# name: (the values that ask for nothing Loraplex lacks; what is missing)
UNSUPPORTED = {
    "revision": ((None,), f"{_LOCAL}: pass the directory of that revision"),
    "tokenizer_revision": ((None,), f"{_LOCAL}: pass tokenizer= the directory of that revision"),
    "code_revision": ((None,), _LOCAL),
    "skip_tokenizer_init": ((False,), "the engine needs the tokenizer (stop strings, detokenized text)"),
    "cpu_offload_gb": ((0,), "weights are never offloaded to the CPU"),
    "pipeline_parallel_size": ((1,), "only tensor parallelism (tensor_parallel_size)"),
    "hf_overrides": ((None, {}), "the model's config.json is used as it is"),
    "task": (("auto", "generate"), "Loraplex only generates text (no embedding, scoring or classification)"),
}

ENGINE_FIELDS = frozenset(f.name for f in dataclasses.fields(EngineConfig))


def engine_options(kwargs: dict) -> dict:
    """The EngineConfig fields among ``LLM(**kwargs)``'s extra keywords; vLLM's own keywords are dropped (with a
    warning where the value would matter under vLLM) or refused; any other keyword is a TypeError."""
    options = {}
    for name, value in kwargs.items():
        if name in ENGINE_FIELDS:
            options[name] = value
        elif name in IGNORED:
            defaults, why = IGNORED[name]
            if not _is_one_of(value, defaults):
                log.warning("LLM: ignoring vLLM's %s=%r: %s", name, value, why)
        elif name in UNSUPPORTED:
            defaults, why = UNSUPPORTED[name]
            if not _is_one_of(value, defaults):
                raise ValueError(f"LLM(): vLLM's {name}={value!r} is not supported: {why}")
        else:
            raise TypeError(f"LLM() got an unexpected keyword argument {name!r}{_did_you_mean(name)}")
    return options


def _is_one_of(value, values: tuple) -> bool:
    # by type too: 0 is not False, and 1.0 (swap_space=4.0 is 4) compares as a number
    return any(value == v and (type(value) is type(v) or not isinstance(v, bool) and not isinstance(value, bool))
               for v in values)


def _did_you_mean(name: str) -> str:
    close = difflib.get_close_matches(name, [*ENGINE_FIELDS, "speculative_config", *IGNORED, *UNSUPPORTED], n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
