"""``loraplex batch INPUT.jsonl OUTPUT.jsonl --model DIR``: offline generation over a JSONL file.

Each input line is an object with ``prompt`` (text) or ``prompt_token_ids``, and optionally ``id``,
``params`` (SamplingParams fields, over the command's defaults) and ``lora`` (``{"name", "id", "path"}``).
Each output line, in input order: ``{"id", "outputs": [{"index", "text", "token_ids", "finish_reason"}],
"num_prompt_tokens", "num_cached_tokens"}``, or ``{"id", "error"}`` for a line that could not run.
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import asdict

from loraplex.engine.lora_request import LoRARequest
from loraplex.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)
CHUNK = 512  # lines in flight at once


def register(subparsers) -> None:
    p = subparsers.add_parser("batch", help="generate for every line of a JSONL file (offline)")
    p.add_argument("input", help="JSONL input (- for stdin)")
    p.add_argument("output", help="JSONL output (- for stdout)")
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--enable-lora", action="store_true")
    p.add_argument("--max-loras", type=int, default=8)
    p.add_argument("--max-lora-rank", type=int, default=64)
    p.set_defaults(func=run)


def _line_id(line: str, line_no: int) -> str:
    try:
        item = json.loads(line)
    except ValueError:
        return str(line_no)
    return str(item.get("id", line_no)) if isinstance(item, dict) else str(line_no)


def _parse(line: str, defaults: dict, line_no: int):
    item = json.loads(line)
    if not isinstance(item, dict):
        raise ValueError("each line must be a JSON object")
    rid = _line_id(line, line_no)
    if "prompt_token_ids" in item:
        prompt = {"prompt_token_ids": [int(t) for t in item["prompt_token_ids"]]}
    elif isinstance(item.get("prompt"), str):
        prompt = item["prompt"]
    else:
        raise ValueError("a line needs 'prompt' (string) or 'prompt_token_ids'")
    params = SamplingParams(**{**defaults, **item.get("params", {})})
    lora = item.get("lora")
    lora_request = LoRARequest(lora["name"], int(lora["id"]), lora["path"]) if lora else None
    return rid, prompt, params, lora_request


def run(args) -> int:
    from loraplex.engine.llm import LLM

    llm = LLM(args.model, device=args.device, dtype=args.dtype, seed=args.seed, max_num_seqs=args.max_num_seqs,
              max_model_len=args.max_model_len, enable_lora=args.enable_lora, max_loras=args.max_loras,
              max_lora_rank=args.max_lora_rank)
    defaults = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    # bytes in: a line that is not UTF-8 is that line's error, not the end of the command
    stdin = getattr(sys.stdin, "buffer", sys.stdin)
    src = stdin if args.input == "-" else open(args.input, "rb")  # noqa: SIM115
    dst = sys.stdout if args.output == "-" else open(args.output, "w", encoding="utf-8")  # noqa: SIM115
    num_ok = num_failed = 0
    try:
        pending: list[tuple] = []
        for line_no, raw in enumerate(src):
            try:
                line = raw.decode("utf-8") if isinstance(raw, bytes) else raw
            except UnicodeDecodeError as exc:
                pending.append((str(line_no), None, None, f"line {line_no} is not UTF-8: {exc}"))
                continue
            if not line.strip():
                continue
            try:
                pending.append(_parse(line, defaults, line_no))
            except (ValueError, TypeError, KeyError) as exc:
                pending.append((_line_id(line, line_no), None, None, str(exc)))
            if len(pending) >= CHUNK:
                ok, failed = _flush(llm, pending, dst)
                num_ok, num_failed = num_ok + ok, num_failed + failed
                pending = []
        ok, failed = _flush(llm, pending, dst)
        num_ok, num_failed = num_ok + ok, num_failed + failed
    finally:
        if src is not stdin:
            src.close()
        if dst is not sys.stdout:
            dst.close()
    log.info("batch done: %d ok, %d failed", num_ok, num_failed)
    return 0 if num_failed == 0 else 1


def _flush(llm, pending: list[tuple], dst) -> tuple[int, int]:
    # each line is queued on its own, so a prompt the engine refuses (too long, ids outside the vocabulary)
    # is that line's error and the rest of the chunk still runs
    results, outputs, errors = {}, {}, {}
    for i, p in enumerate(pending):
        if p[1] is None:
            continue
        try:
            request_id, out = llm._add_request(p[1], p[2], p[3], 0)
        except ValueError as exc:
            errors[i] = str(exc)
            continue
        outputs[request_id] = out
        results[i] = out
    if outputs:
        llm._run(outputs)
    num_failed = 0
    for i, p in enumerate(pending):
        rid = p[0]
        out = results.get(i)
        if out is None:
            record = {"id": rid, "error": errors.get(i, p[3])}
            num_failed += 1
        else:
            record = {"id": rid, "num_prompt_tokens": len(out.prompt_token_ids),
                      "num_cached_tokens": out.num_cached_tokens,
                      "outputs": [{k: v for k, v in asdict(c).items() if k in ("index", "text", "token_ids",
                                   "finish_reason", "stop_reason", "error")} for c in out.outputs]}
            num_failed += any(c.finish_reason == "error" for c in out.outputs)
        dst.write(json.dumps(record) + "\n")
    return len(pending) - num_failed, num_failed
