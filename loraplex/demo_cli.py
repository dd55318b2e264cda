"""``loraplex demo-model OUT_DIR``: write a small random Llama-family model + tokenizer + adapters."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

MANIFEST = "loraplex_demo.json"  # what build_demo_model writes last


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
    try:
        _check(args)
        from loraplex.demo import DemoModelSpec, build_demo_model

        spec = DemoModelSpec(
            arch=args.arch, layers=args.layers, hidden_size=args.hidden_size, heads=args.heads,
            kv_heads=args.kv_heads, intermediate_size=args.intermediate_size, vocab_size=args.vocab_size,
            rope_scaling=args.rope_scaling, adapters=args.adapters, seed=args.seed,
        )
        manifest = build_demo_model(args.out_dir, spec)
    except (ValueError, OSError) as exc:
        message = f"{args.out_dir}: {exc.strerror}" if isinstance(exc, OSError) and exc.strerror else str(exc)
        print(f"loraplex demo-model: error: {message}", file=sys.stderr)
        return 2
    print(json.dumps(manifest, indent=2))
    return 0


def _check(args: argparse.Namespace) -> None:
    """ValueError naming the flag for a shape no model can have, or an OUT_DIR that holds something else."""
    for flag in ("layers", "hidden_size", "heads", "kv_heads", "intermediate_size", "vocab_size", "adapters"):
        value, least = getattr(args, flag), 0 if flag == "adapters" else 1
        if value is not None and value < least:
            raise ValueError(f"--{flag.replace('_', '-')} must be at least {least}, got {value}")
    from loraplex.demo import SPECIAL_TOKENS

    least_vocab = 256 + len(SPECIAL_TOKENS)  # the byte-level alphabet and the special tokens, before any merge
    if args.vocab_size < least_vocab:
        raise ValueError(f"--vocab-size must be at least {least_vocab} (the tokenizer's bytes and special tokens), "
                         f"got {args.vocab_size}")
    if args.hidden_size % args.heads or args.heads % args.kv_heads:
        raise ValueError(f"--hidden-size ({args.hidden_size}) must divide by --heads ({args.heads}), and --heads "
                         f"by --kv-heads ({args.kv_heads})")
    head_dim = args.hidden_size // args.heads
    if head_dim % 2:  # rotary embeddings turn pairs of a head's features: an odd head size runs nowhere
        raise ValueError(f"--hidden-size / --heads must be even (the head size, rotary embeddings turn pairs of its "
                         f"features), got {args.hidden_size} / {args.heads} = {head_dim}")
    out = Path(args.out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is not a directory")
    # an earlier demo model is rewritten; anything else (someone's model, a source tree) is never written over
    if out.is_dir() and any(out.iterdir()) and not (out / MANIFEST).is_file():
        raise ValueError(f"{out} is not empty and holds no demo model ({MANIFEST}): pass a new or empty directory")
