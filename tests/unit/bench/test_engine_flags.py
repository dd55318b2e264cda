"""The benchmarks' engine-option flags: each names a real ``EngineConfig`` field, and what a command line sets reaches
the engine's keyword arguments (left out: None or off, so the engine's default applies)."""

from __future__ import annotations

import argparse
import dataclasses

from loraplex.bench import engine_flags
from loraplex.bench.cli import add_offline_args
from loraplex.bench.step_profile import add_step_profile_args
from loraplex.engine.config import EngineConfig


def test_every_flag_is_an_engine_option_and_every_list_names_known_flags():
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    assert set(engine_flags.FLAGS) <= fields
    assert set(engine_flags.OFFLINE) == set(engine_flags.FLAGS)
    assert set(engine_flags.STEP_PROFILE) <= set(engine_flags.FLAGS)


def test_a_command_line_reaches_the_engine_kwargs():
    p = argparse.ArgumentParser()
    add_offline_args(p)
    args = p.parse_args(["--lora-gemm-shrink", "--lora-expand-first-min-tokens", "7", "--kv-cache-dtype", "int8",
                         "--lora-grouping", "--no-piecewise-cuda-graphs"])
    kw = engine_flags.engine_kwargs(args, engine_flags.OFFLINE)
    assert kw["lora_gemm_shrink"] is True and kw["lora_expand_first_min_tokens"] == 7
    assert kw["kv_cache_dtype"] == "int8" and kw["lora_grouping"] is True and kw["piecewise_cuda_graphs"] is False
    assert kw["lora_overlap_shrink"] is None and kw["quantization"] is None and kw["fuse_lora_silu_mul"] is False
    assert args.tensor_parallel_size == 1  # not an engine flag of this module: the bench handles it itself

    q = argparse.ArgumentParser()
    add_step_profile_args(q)
    kw = engine_flags.engine_kwargs(q.parse_args(["--lora-gemm-shrink", "--merge-single-lora",
                                                  "--lora-fold-shrink-max-tokens", "256"]),
                                    engine_flags.STEP_PROFILE)
    assert kw == {"fuse_lora_silu_mul": False, "lora_overlap_shrink": None, "lora_gemm_shrink": True,
                  "merge_single_lora": True, "lora_fold_shrink_max_tokens": 256, "attention_decode_split": None,
                  "piecewise_cuda_graphs": None}
    # a namespace without some options (another benchmark's) gives only those it has
    assert engine_flags.engine_kwargs(argparse.Namespace(lora_gemm_shrink=True), engine_flags.OFFLINE) == {
        "lora_gemm_shrink": True}
