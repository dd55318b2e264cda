"""loraplex's own line format for ``loraplex batch``, and the decoding both formats share.

Input line: ``{"id", "prompt" | "prompt_token_ids", "params": {SamplingParams fields}, "lora": {"name", "id",
"path"}}``. Output line: ``{"id", "outputs": [{"index", "text", "token_ids", "finish_reason", "stop_reason",
"error"}], "num_prompt_tokens", "num_cached_tokens"}`` (plus logprobs where the line's params ask for them), or
``{"id", "error"}``. OpenAI's batch format is openai_format.py's; both share the decoding (JSON as the server reads
it), the seed of a line that names none, and how a value is shown in an error message.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable
from typing import Any

import msgspec

from loraplex.batch.window import Line
from loraplex.engine.lora_request import LoRARequest
from loraplex.engine.outputs import CompletionOutput, Logprob, RequestOutput
from loraplex.engine.sampling_params import SamplingParams, _is_int
from loraplex.platform.json_body import out_of_range, out_of_range_field

NOT_AN_OBJECT = object()
_PARAM_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))
_OUTPUT_FIELDS = ("index", "text", "token_ids", "finish_reason", "stop_reason", "error")


def decode(line_no: int, raw: bytes):
    """(the line's object, or NOT_AN_OBJECT; why it is not an object, or None). The line is read as the server reads a
    body: strict JSON, so ``NaN``, ``Infinity``, a lone UTF-16 surrogate escape (``"\\udc80"``, which no UTF-8 text
    holds) and a number no 64-bit float holds (``1e400``) make it no JSON, never a value that fails later."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return NOT_AN_OBJECT, f"line {line_no} is not UTF-8: {exc}"
    try:
        item = msgspec.json.decode(raw)
    except msgspec.ValidationError:  # "Number out of range" (a DecodeError too): where, msgspec does not say
        return NOT_AN_OBJECT, f"line {line_no} is not JSON: {out_of_range(out_of_range_field(raw)).message}"
    except msgspec.DecodeError as exc:
        return NOT_AN_OBJECT, f"line {line_no} is not JSON: {exc}"
    except RecursionError:
        return NOT_AN_OBJECT, f"line {line_no} is not JSON: it nests objects or arrays too deeply to parse"
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


def short(value, limit: int = 60) -> str:
    """A value for an error message, cut to ``limit`` characters (a line may hold a huge list)."""
    text = json.dumps(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


class LoraplexFormat:
    """loraplex's own lines (window.LineFormat). ``defaults``: the SamplingParams fields of a line's params that it
    does not set (``--max-tokens``, ``--temperature``); ``refusal_text``: the engine's refusal of a line as its error
    says it (the command names its flags where the engine names its config fields)."""

    def __init__(self, defaults: dict, enable_lora: bool, seed: int, refusal_text: Callable[[str], str] = str):
        self.defaults, self.enable_lora, self.seed, self.refusal_text = defaults, enable_lora, seed, refusal_text

    def parse(self, seq: int, line_no: int, raw: bytes) -> Line:
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
            lora = _lora_request(item["lora"], self.enable_lora) if item.get("lora") is not None else None
            params = SamplingParams(**{**self.defaults, "seed": line_seed(self.seed, rid), **params})
            return Line(seq, line_no, rid, prompt, params, lora)
        except (ValueError, TypeError) as exc:
            return Line(seq, line_no, rid, error=str(exc))

    def line_id(self, line_no: int, raw: bytes) -> Any:
        return line_id(decode(line_no, raw)[0], line_no)

    def observe(self, line: Line, delta) -> None:
        pass  # the record is made of the request's whole output

    def finished(self, line: Line, out: RequestOutput, failed: bool) -> dict:
        record = {"id": line.id, "num_prompt_tokens": len(out.prompt_token_ids),
                  "num_cached_tokens": out.num_cached_tokens,
                  "outputs": [_output_record(c, line.params.logprobs is not None, self.refusal_text)
                              for c in out.outputs]}
        if line.params.prompt_logprobs is not None:
            record["prompt_logprobs"] = [_logprob_entry(e) for e in out.prompt_logprobs or []]
        return record

    def refused(self, line: Line) -> dict:
        return {"id": line.id, "error": line.error}

    def engine_refused(self, line: Line, exc: ValueError) -> str:
        return self.refusal_text(str(exc))

    def crashed(self, exc: Exception) -> str:
        return f"internal error: {type(exc).__name__}: {exc} (a defect of loraplex batch, logged with its traceback)"


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


def _output_record(comp: CompletionOutput, with_logprobs: bool, error_text: Callable[[str], str] = str) -> dict:
    record = {k: getattr(comp, k) for k in _OUTPUT_FIELDS}
    if record["error"] is not None:  # (an adapter that failed to load: named as the user's flags name it)
        record["error"] = error_text(record["error"])
    if with_logprobs:  # only when the line asked for them: they are most of a line's size
        record["logprobs"] = [_logprob_entry(e) for e in comp.logprobs or []]
        record["cumulative_logprob"] = comp.cumulative_logprob
    return record


def _logprob_entry(entry: dict[int, Logprob] | None) -> dict[str, dict] | None:
    """One position's logprobs as vLLM's API writes them: token id (a JSON key, so a string) -> its logprob,
    rank and text."""
    if entry is None:
        return None
    return {str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
            for t, lp in entry.items()}
