"""What verifying draft tokens costs a decode step: the step time with k draft tokens per sequence, k = 0, 1, 2, 4,
on the Llama-3-8B shape (random bf16 weights), base model and distinct adapters, in the same run.

    python -m loraplex.bench.spec_cost [--batch 64] [--context 1024] [--drafts 0,1,2,4] [--out ...] [--smoke]

A random-weight model accepts almost no prompt-lookup drafts, so this bench does not measure acceptance: every
decoding sequence is given exactly k draft tokens each step (a fixed proposer: its newest token repeated), which
the step computes and verifies. With the step time t_k against t_0 and an acceptance rate a per draft token, a
step emits (1 - a^(k+1)) / (1 - a) tokens on average, so speculation pays when that exceeds t_k / t_0; the report
gives each k's break-even acceptance rate. Overlapped steps are off in every run (speculation turns them off), so
the k = 0 row is the engine without overlap.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

import torch

from loraplex.bench.report import markdown_head

log = logging.getLogger("loraplex.bench.spec_cost")


class FixedProposer:
    """Exactly ``k`` draft tokens for every sequence that may speculate (its newest token, repeated)."""

    def __init__(self, k: int):
        self.num_tokens = k

    def propose(self, token_ids: list[int], max_tokens: int | None = None, key: int | None = None) -> list[int]:
        k = self.num_tokens if max_tokens is None else min(self.num_tokens, max_tokens)
        return [token_ids[-1]] * max(k, 0)

    def forget(self, key: int) -> None:
        pass


def break_even(ratio: float, k: int) -> float | None:
    """The acceptance rate a per draft token at which (1 - a^(k+1)) / (1 - a) = ratio (bisection); None when even
    a = 1 (k + 1 tokens per step) does not pay for the step."""
    if k == 0 or ratio > k + 1:
        return None
    if ratio <= 1:
        return 0.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        tokens = (k + 1) if mid == 1 else (1 - mid ** (k + 1)) / (1 - mid)
        lo, hi = (mid, hi) if tokens < ratio else (lo, mid)
    return (lo + hi) / 2


def run(args, device: torch.device) -> dict:
    from loraplex.bench.llama8b import write_adapter_pool
    from loraplex.bench.offline import make_llm, measure_decode_step
    from loraplex.bench.offline_run import prepare_model

    model_dir = prepare_model(args, device)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    adapters = write_adapter_pool(model_dir, args.batch, args.rank, device)
    drafts = [int(k) for k in args.drafts.split(",")]
    llm = make_llm(model_dir, str(device), args.dtype, min(args.batch, args.max_loras), args.rank,
                   max_num_seqs=max(args.batch, 8), num_speculative_tokens=max(max(drafts), 1), async_scheduling=False,
                   seed=args.seed)
    scheduler = llm.engine.scheduler
    rows = []
    for distinct in (False, True):
        for rep in range(args.repeats):
            for k in drafts:
                scheduler.proposer = FixedProposer(k) if k else None
                before = scheduler.num_draft_tokens
                step = measure_decode_step(llm, args.batch, args.context, args.steps, vocab, adapters,
                                           distinct_adapters=distinct, seed=args.seed + rep)
                rows.append({"adapters": "distinct" if distinct else "base", "drafts": k, "round": rep + 1,
                             "draft_tokens_verified": scheduler.num_draft_tokens - before, **step})
                log.info("SPEC-COST %s", rows[-1])
    # per (adapters, k): the median over rounds, and its ratio to k = 0 of the same adapters
    table = []
    for label in ("base", "distinct"):
        base = None
        for k in drafts:
            times = sorted(r["step_median_s"] for r in rows if r["adapters"] == label and r["drafts"] == k)
            t = times[(len(times) - 1) // 2]
            base = t if k == 0 else base
            ratio = t / base if base else None
            table.append({"adapters": label, "drafts": k, "step_ms": t * 1e3, "over_no_drafts": ratio,
                          "break_even_acceptance": break_even(ratio, k) if ratio is not None else None})
    return {"rows": rows, "table": table, "batch": args.batch, "context": args.context}


def markdown(payload: dict) -> str:
    lines = [*markdown_head("Speculative decoding: the cost of verifying drafts", payload["command"]),
             f"Environment: {payload['environment']}. Batch {payload['batch']}, context ~{payload['context']}; "
             "every sequence carries exactly k draft tokens per step; median step of the rounds. Break-even: the "
             "acceptance rate per draft token at which the tokens per step pay for the longer step.", "",
             "| adapters | drafts k | step ms | ÷ no drafts | break-even acceptance |", "|---|---|---|---|---|"]
    for r in payload["table"]:
        ratio = "—" if r["over_no_drafts"] is None else f"{r['over_no_drafts']:.3f}"
        be = r["break_even_acceptance"]
        be = "—" if r["drafts"] == 0 else ("never" if be is None else f"{be:.2f}")
        lines.append(f"| {r['adapters']} | {r['drafts']} | {r['step_ms']:.2f} | {ratio} | {be} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loraplex.bench.spec_cost", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="docs/benchmarks/spec_cost.json", help="JSON path (.md beside it)")
    parser.add_argument("--smoke", action="store_true", help="a tiny model on the CPU (checks the harness)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--drafts", default="0,1,2,4")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--max-loras", type=int, default=64)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--model", default=None, help="a model directory (default: the random 8B-shaped one)")
    parser.add_argument("--work-dir", default="/tmp/loraplex-bench")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if args.smoke:
        args.batch, args.context, args.steps, args.repeats, args.rank = 3, 16, 3, 1, 8
        args.max_loras, args.dtype, args.drafts = 4, "float32", "0,2"
    from loraplex.bench.report import module_command, write_json_and_markdown

    payload = run(args, device)
    payload["command"] = module_command("loraplex.bench.spec_cost", argv)
    payload["environment"] = (f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, "
                              f"torch {torch.__version__}, {args.dtype}")
    write_json_and_markdown(args.out, payload, markdown(payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
