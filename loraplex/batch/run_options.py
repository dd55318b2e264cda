"""The options a ``loraplex batch`` run generates with, kept beside its OUTPUT in ``OUTPUT.options.json``, so that
``--resume`` can refuse to continue with other ones (the kept lines and the new ones would not be one job)."""

from __future__ import annotations

import json
import os

# the flags that change what a line produces; scheduling flags (--max-num-seqs, --max-in-flight, ...) do not
FLAGS = ("model", "tokenizer", "device", "dtype", "kv_cache_dtype", "max_tokens", "temperature", "seed",
         "max_model_len", "enable_lora", "max_lora_rank", "lora_modules")
# flags recorded since a later release: an options file without one was written with the flag's default
RECORDED_LATER = {"kv_cache_dtype": "auto", "tokenizer": None, "lora_modules": None}


def path_of(output: str) -> str:
    return output + ".options.json"


def of_args(args) -> dict:
    options = {name: getattr(args, name) for name in FLAGS}
    for name in ("model", "tokenizer"):
        if options[name] is not None and os.path.exists(options[name]):  # the same directory however it is spelled
            options[name] = os.path.realpath(options[name])
    if options["lora_modules"] is not None:  # NAME=PATH, each PATH resolved as --model is
        options["lora_modules"] = [f"{name}={os.path.realpath(path)}" for name, _, path in
                                   (value.partition("=") for value in options["lora_modules"])]
    return options


def recorded(output: str) -> dict | None:
    """The options the run that wrote ``output`` recorded; None when it recorded none. ValueError: unreadable."""
    try:
        with open(path_of(output), "rb") as f:
            options = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ValueError(str(exc)) from None
    if not isinstance(options, dict):
        raise ValueError("not a JSON object")
    return options


def differences(earlier: dict, options: dict) -> list[str]:
    """``--flag VALUE (earlier VALUE)`` for each flag whose value differs from the earlier run's."""
    earlier = {**RECORDED_LATER, **earlier}
    return [f"--{name.replace('_', '-')} {json.dumps(options[name])} (earlier {json.dumps(earlier.get(name))})"
            for name in FLAGS if earlier.get(name) != options[name]]


def record(output: str, options: dict) -> None:
    """Write the options beside ``output``, whole or not at all."""
    path = path_of(output)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(options, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
