"""One input line of ``loraplex batch``: decoding it, and what loraplex's own line format asks for.

A line of loraplex's format is ``{"id", "prompt" | "prompt_token_ids", "params": {SamplingParams fields},
"lora": {"name", "id", "path"}}``; OpenAI's batch format is openai_format.py's. Both share the decoding, the
seed of a line that names none, and how a value is shown in an error message.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

from loraplex.batch.window import Line
from loraplex.engine.lora_request import LoRARequest
from loraplex.engine.sampling_params import SamplingParams, _is_int

NOT_AN_OBJECT = object()
_PARAM_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


def decode(line_no: int, raw: bytes):
    """(the line's object, or NOT_AN_OBJECT; why it is not an object, or None)."""
    try:
        item = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        return NOT_AN_OBJECT, f"line {line_no} is not UTF-8: {exc}"
    except ValueError as exc:
        return NOT_AN_OBJECT, f"line {line_no} is not JSON: {exc}"
    if not isinstance(item, dict):
        return NOT_AN_OBJECT, f"line {line_no} is not a JSON object"
    return item, None


def line_id(item, line_no: int):
    """A loraplex-format line's id: its ``id`` as given, else (no id, or not an object) its line number."""
    return line_no if item is NOT_AN_OBJECT else item.get("id", line_no)


def line_seed(seed: int, rid) -> int:
    """The sampling seed of a line whose params name none: from ``--seed`` and the line's id alone, so a sampled line
    gives the same tokens whatever ran beside it, with any --max-num-seqs, and when --resume runs it."""
    digest = hashlib.sha256(f"{seed}:{json.dumps(rid, sort_keys=True)}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 2  # below 2**62


def token_ids(value, field: str) -> list[int]:
    """A prompt of token ids as given: no int() casts, since 1.7, true or "1" would run as another prompt than the
    line asked for. ValueError naming ``field``."""
    if not isinstance(value, list) or not all(_is_int(t) for t in value):
        raise ValueError(f"{field}: must be a list of integers (token ids), got {short(value)}")
    return value


def parse(seq: int, line_no: int, raw: bytes, defaults: dict, enable_lora: bool, seed: int = 0) -> Line:
    """A line of loraplex's own format: what to run, or why it cannot run."""
    item, error = decode(line_no, raw)
    rid = line_id(item, line_no)
    if error is not None:
        return Line(seq, line_no, rid, error=error)
    try:
        if "prompt_token_ids" in item:
            prompt = {"prompt_token_ids": token_ids(item["prompt_token_ids"], "prompt_token_ids")}
        elif isinstance(item.get("prompt"), str):
            prompt = item["prompt"]
        else:
            raise ValueError("a line needs 'prompt' (string) or 'prompt_token_ids'")
        params = item.get("params", {})
        if not isinstance(params, dict):
            raise ValueError("'params' must be an object of SamplingParams fields")
        unknown = sorted(params.keys() - _PARAM_FIELDS)
        if unknown:
            raise ValueError(f"params.{unknown[0]}: not a SamplingParams field")
        lora = _lora_request(item["lora"], enable_lora) if item.get("lora") is not None else None
        return Line(seq, line_no, rid, prompt, SamplingParams(**{**defaults, "seed": line_seed(seed, rid), **params}),
                    lora)
    except (ValueError, TypeError) as exc:
        return Line(seq, line_no, rid, error=str(exc))


def _lora_request(lora, enable_lora: bool) -> LoRARequest:
    if not (isinstance(lora, dict) and {"name", "id", "path"} <= lora.keys()):
        raise ValueError("'lora' must be an object with 'name', 'id' and 'path'")
    for key, ok, what in (("name", isinstance(lora["name"], str), "a string"),
                          ("id", _is_int(lora["id"]) and lora["id"] >= 1, "an integer >= 1 (0 is the base model)"),
                          ("path", isinstance(lora["path"], str), "a string (a PEFT adapter directory)")):
        if not ok:
            raise ValueError(f"lora.{key}: must be {what}, got {short(lora[key])}")
    if not enable_lora:  # the engine's own message names its field, enable_lora, not the flag the user types
        raise ValueError(f"lora: adapter {lora['name']!r} needs --enable-lora (this run has no adapters)")
    return LoRARequest(lora["name"], lora["id"], lora["path"])


def short(value, limit: int = 60) -> str:
    """A value for an error message, cut to ``limit`` characters (a line may hold a huge list)."""
    text = json.dumps(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
