"""The engine options the benchmarks take as flags: one definition each (``--name-with-dashes`` for the
``EngineConfig`` field ``name_with_underscores``), shared by ``bench offline`` / ``bench all`` and
``bench step-profile``, and the keyword arguments they give the engine.

A flag left out on the command line is None (or False for an on/off switch whose engine default is off), and
``make_llm`` passes only the options that are not None, so the engine's own default applies."""

from __future__ import annotations

import argparse

_ON_OFF = dict(action=argparse.BooleanOptionalAction, default=None)

FLAGS: dict[str, dict] = {
    "fuse_lora_silu_mul": dict(
        action="store_true",
        help="engine option fuse_lora_silu_mul: gate|up's LoRA delta added inside SiLU-and-multiply"),
    "lora_silu_mul_min_tokens": dict(
        type=int, default=None,
        help="engine option lora_silu_mul_min_tokens: steps of at least this many tokens add gate|up's LoRA delta "
             "inside SiLU-and-multiply (0: never; default: the engine's default)"),
    "merge_single_lora": dict(
        action="store_true",
        help="engine option merge_single_lora: while every step has one adapter and no base token (identical "
             "popularity), that adapter is folded into the base weights"),
    "lora_overlap_shrink": dict(
        **_ON_OFF,
        help="engine option lora_overlap_shrink: each LoRA shrink on a forked CUDA stream alongside the base GEMM "
             "(default: the engine's default)"),
    "lora_expand_first_min_tokens": dict(
        type=int, default=None,
        help="engine option lora_expand_first_min_tokens: steps of at least this many tokens run the LoRA work "
             "before the base GEMM, which accumulates into its output (0: never; default: the engine's default)"),
    "lora_segment_tiles": dict(
        **_ON_OFF,
        help="engine option lora_segment_tiles: eager steps of 3,584+ tokens whose tokens sit mostly in requests of "
             "more than 32 get the LoRA kernels' prefill tiles (default: the engine's default)"),
    "lora_gemm_shrink": dict(
        **_ON_OFF,
        help="engine option lora_gemm_shrink: pure-decode steps of at most --lora-gemm-shrink-max-tokens tokens run "
             "each LoRA shrink inside the base GEMM, over the first slots (4, 8, ... max_loras) that their adapters "
             "fill half of (default: the engine's default, off)"),
    "lora_gemm_shrink_max_tokens": dict(
        type=int, default=None,
        help="engine option lora_gemm_shrink_max_tokens: the largest decode step --lora-gemm-shrink takes (default: "
             "the engine's default)"),
    "lora_gemm_shrink_max_moves": dict(
        type=int, default=None,
        help="engine option lora_gemm_shrink_max_moves: adapters a decode step may move into the first slots for "
             "--lora-gemm-shrink (0: never; default: the engine's default)"),
    "lora_fold_shrink_max_tokens": dict(
        type=int, default=None,
        help="engine option lora_fold_shrink_max_tokens: steps of at most this many tokens run the down projection's "
             "LoRA shrink inside SiLU-and-multiply (0: never; default: the engine's default)"),
    "attention_decode_split": dict(
        **_ON_OFF,
        help="engine option attention_decode_split: in steps mixing decodes and prompts, the decodes through the "
             "split-KV decode kernel (default: the engine's default, on)"),
    "piecewise_cuda_graphs": dict(
        **_ON_OFF,
        help="engine option piecewise_cuda_graphs: prefill and mixed steps replay CUDA graphs captured around "
             "attention (default: the engine's default, on)"),
    "kv_cache_dtype": dict(
        choices=("auto", "fp8", "fp8_e4m3", "int8"), default=None,
        help="engine option kv_cache_dtype (default: the engine's default, auto = the model's dtype)"),
    "quantization": dict(
        choices=("int8", "fp8"), default=None,
        help="engine option quantization: the base projections as INT8 or FP8 weight-only (the roofline counts one "
             "byte per weight and the row scales; default: the weights as stored)"),
    "num_speculative_tokens": dict(
        type=int, default=None,
        help="engine option num_speculative_tokens: prompt-lookup drafts per sequence and step (default: the "
             "engine's default, 0 = off; random prompts seldom repeat, so drafts are few)"),
    "lora_grouping": dict(
        action="store_true",
        help="engine option lora_grouping: admit waiting requests whose adapter already runs first, the others "
             "grouped by adapter (instead of FCFS)"),
}

# the options of each benchmark, in the order of its --help
OFFLINE = ("fuse_lora_silu_mul", "lora_silu_mul_min_tokens", "merge_single_lora", "lora_overlap_shrink",
           "lora_expand_first_min_tokens", "lora_segment_tiles", "lora_gemm_shrink", "lora_gemm_shrink_max_tokens",
           "lora_gemm_shrink_max_moves", "lora_fold_shrink_max_tokens", "attention_decode_split", "piecewise_cuda_graphs",
           "kv_cache_dtype", "quantization", "num_speculative_tokens", "lora_grouping")
STEP_PROFILE = ("fuse_lora_silu_mul", "lora_overlap_shrink", "lora_gemm_shrink", "merge_single_lora",
                "lora_fold_shrink_max_tokens", "attention_decode_split", "piecewise_cuda_graphs")


def add_flags(parser, names) -> None:
    """One ``--flag`` per engine option in ``names`` (keys of ``FLAGS``)."""
    for name in names:
        parser.add_argument("--" + name.replace("_", "-"), **FLAGS[name])


def engine_kwargs(args, names) -> dict:
    """{option: value} of the options in ``names`` that ``args`` has (a namespace built by another parser, e.g.
    ``bench all``'s for its offline part, may lack some)."""
    return {name: getattr(args, name) for name in names if hasattr(args, name)}
