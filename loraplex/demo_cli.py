"""``loraplex demo-model OUT_DIR``: write a small random Llama-family model + tokenizer + adapters."""

from __future__ import annotations

import argparse
import json


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo-model", help="write a small Llama-architecture model, tokenizer and PEFT adapters")
    p.add_argument("out_dir")
    p.add_argument("--arch", default="llama", choices=["llama", "mistral", "qwen2"])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate-size", type=int, default=None)
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--rope-scaling", choices=["llama3"], default=None)
    p.add_argument("--adapters", type=int, default=4, help="number of PEFT adapters (mixed ranks)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from loraplex.demo import DemoModelSpec, build_demo_model

    spec = DemoModelSpec(
        arch=args.arch, layers=args.layers, hidden_size=args.hidden_size, heads=args.heads,
        kv_heads=args.kv_heads, intermediate_size=args.intermediate_size, vocab_size=args.vocab_size,
        rope_scaling=args.rope_scaling, adapters=args.adapters, seed=args.seed,
    )
    manifest = build_demo_model(args.out_dir, spec)
    print(json.dumps(manifest, indent=2))
    return 0
