"""The options a ``loraplex batch`` run generates with, kept beside its OUTPUT in ``OUTPUT.options.json``, so that
``--resume`` can refuse to continue with other ones (the kept lines and the new ones would not be one job)."""

from __future__ import annotations

import json
import os

from loraplex.batch.openai_format import lora_module

# the flags that change what a line produces. --max-num-seqs is one: a line whose n exceeds it fails. Flags that only
# schedule (--max-in-flight, --reorder-buffer, --progress-interval) are not
FLAGS = ("model", "tokenizer", "device", "dtype", "kv_cache_dtype", "max_tokens", "temperature", "seed",
         "max_model_len", "max_num_seqs", "enable_lora", "max_lora_rank", "served_model_name", "lora_modules")
# the server's request limits an OpenAI-format run checks bodies against (Settings, LORAPLEX_<NAME>)
SETTINGS = ("max_tokens_limit", "max_n", "max_stop_sequences")
# recorded since a later release: an options file without one was written with this value
RECORDED_LATER = {"kv_cache_dtype": "auto", "tokenizer": None, "lora_modules": None, "served_model_name": None}
# recorded since a later release, and the earlier value cannot be told: not compared where the file lacks them
UNKNOWN_BEFORE = frozenset({"max_num_seqs", *SETTINGS})


def path_of(output: str) -> str:
    return output + ".options.json"


def of_args(args, line_defaults: dict | None, limits: dict | None) -> dict:
    """``line_defaults``: max_tokens and temperature of loraplex-format lines (None: OpenAI-format lines, which do not
    read them); ``limits``: the server's request limits OpenAI-format bodies are checked against (None: loraplex
    format, which has none)."""
    options = {name: getattr(args, name) for name in FLAGS}
    options.update(line_defaults or {"max_tokens": None, "temperature": None})
    for name in ("model", "tokenizer"):
        if options[name] is not None and os.path.exists(options[name]):  # the same directory however it is spelled
            options[name] = os.path.realpath(options[name])
    if options["lora_modules"] is not None:  # as NAME=PATH whichever form was given, each PATH resolved as --model is
        options["lora_modules"] = [f"{m.name}={os.path.realpath(m.path)}"
                                   for m in map(lora_module, options["lora_modules"])]
    options.update(limits or dict.fromkeys(SETTINGS))
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
    """``--flag VALUE (earlier VALUE)`` (``LORAPLEX_SETTING`` for a setting) for each option whose value differs from
    the earlier run's."""
    earlier = {**RECORDED_LATER, **earlier}
    return [f"{_label(name)} {json.dumps(options[name])} (earlier {json.dumps(earlier.get(name))})"
            for name in (*FLAGS, *SETTINGS)
            if (name in earlier or name not in UNKNOWN_BEFORE) and earlier.get(name) != options[name]]


def _label(name: str) -> str:
    return f"LORAPLEX_{name.upper()}" if name in SETTINGS else f"--{name.replace('_', '-')}"


def record(output: str, options: dict) -> None:
    """Write the options beside ``output``, whole or not at all."""
    path = path_of(output)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(options, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
