"""``loraplex bench offline``: model + adapters, the HF + PEFT peer, throughput by popularity, decode step vs
roofline, one report. The peer runs first and frees the GPU before the engine takes its KV cache."""

from __future__ import annotations

import gc
import json
import logging
from pathlib import Path

import torch

from loraplex.bench.engine_flags import OFFLINE, engine_kwargs

log = logging.getLogger(__name__)


def smoke_settings(args) -> None:
    """CPU-sized settings: the tiny demo-model shape, a handful of requests."""
    args.layers = 2
    args.num_requests = min(args.num_requests, 6)
    args.input_len, args.output_len = 12, 4
    args.rank = min(args.rank, 8)
    args.num_adapter_files, args.max_loras, args.max_num_seqs = 3, 4, 8
    args.step_batch, args.step_context, args.step_count = 3, 16, 3
    args.peer_requests, args.peer_batch, args.peer_adapters = 2, 2, 2
    args.dtype = "float32"


def prepare_model(args, device: torch.device) -> Path:
    from loraplex.bench.llama8b import RandomModelSpec, write_random_model

    if args.model:
        return Path(args.model)
    if args.smoke:
        spec = RandomModelSpec(num_layers=2, hidden_size=64, intermediate_size=176, num_heads=4, num_kv_heads=2,
                               vocab_size=512, max_position_embeddings=512)
        return write_random_model(Path(args.work_dir) / "smoke-model", spec, device)
    spec = RandomModelSpec(num_layers=args.layers)
    return write_random_model(Path(args.work_dir) / f"llama3-8b-shape-{args.layers}l", spec, device)


def run_offline_bench(args, device: torch.device, out_dir: str | None) -> int:
    from loraplex.bench.report import write_report

    result, sections = collect_offline(args, device)
    json_path, md_path = write_report("offline", result, sections, out_dir, args)
    print(md_path.read_text())
    print(f"wrote {json_path} and {md_path}")
    return 0


def collect_offline(args, device: torch.device, clock=None, result: dict | None = None
                    ) -> tuple[dict, list[tuple[str, str]]]:
    """Run the offline benchmark; returns the raw figures and the report's markdown sections.

    ``clock`` (``timing.SectionClock``) times each part; ``result`` (a dict) is filled in place as each part
    ends, so a caller whose run is cut short still has the parts that finished (``offline_sections`` turns
    them into the report's sections). Order: peer, engine, the decode step vs its floor, then each popularity
    (the slowest, distinct, last by default)."""
    from loraplex.bench.llama8b import write_adapter_pool
    from loraplex.bench.offline import (
        adapter_rank_of,
        add_over_base,
        make_llm,
        measure_decode_step,
        run_popularities,
    )
    from loraplex.bench.report import environment
    from loraplex.bench.roofline import (
        ModelShape,
        decode_step_bytes,
        measure_copy_bandwidth,
        measure_h2d_bandwidth,
        measure_matmul_flops,
        roofline,
        workload_floor,
    )
    from loraplex.bench.timing import SectionClock

    clock = clock or SectionClock(log, "bench offline")
    result = {} if result is None else result
    if args.smoke:
        smoke_settings(args)
    with clock("model and adapter files"):
        model_dir = prepare_model(args, device)
        hf_cfg = json.loads((model_dir / "config.json").read_text())
        shape = ModelShape.from_hf(hf_cfg)
        num_files = max(args.num_adapter_files, args.peer_adapters if args.peer != "none" else 0)
        adapter_dirs = write_adapter_pool(model_dir, num_files, args.rank, device)
    dtype = getattr(torch, args.dtype)
    elem = torch.empty((), dtype=dtype).element_size()
    kv_name = getattr(args, "kv_cache_dtype", None)  # the floors' KV bytes per value (int8: + its row scale)
    kv_elem = 1 if kv_name in ("fp8", "fp8_e4m3") else 1 + 4 / shape.head_dim if kv_name == "int8" else elem
    quant = getattr(args, "quantization", None)  # the floors' projection bytes (int8: + a scale per row)
    tp = getattr(args, "tensor_parallel_size", 1) or 1
    # the floors of a run over tp GPUs: tp times one GPU's rates (each rank moves 1/tp of the weights and KV; the
    # replicated parts and the all-reduces are not counted, so the floors are optimistic there)
    bandwidth = tp * measure_copy_bandwidth(device, nbytes=(1 << 30) if device.type == "cuda" else 1 << 24)
    matmul_flops = tp * measure_matmul_flops(device)
    h2d_bandwidth = measure_h2d_bandwidth(device, nbytes=(1 << 28) if device.type == "cuda" else 1 << 22)
    result.update({"environment": environment(device), "model_dir": str(model_dir), "model_shape": vars(shape),
                   "copy_bandwidth_Bps": bandwidth, "matmul_flops_per_s": matmul_flops,
                   "h2d_bandwidth_Bps": h2d_bandwidth, "section_wall_s": clock.walls,
                   "settings": {k: v for k, v in vars(args).items()
                                if k not in ("func", "bench_parser", "report_command")}})

    if args.peer == "hf-peft":
        from loraplex.bench.peer_hf import run_hf_peft

        with clock("peer (HF + PEFT)"):
            result["peer"] = run_hf_peft(
                model_dir, adapter_dirs[: args.peer_adapters], device, dtype, args.peer_requests, args.peer_batch,
                args.input_len, args.peer_output_len or args.output_len, shape.vocab_size, seed=args.seed)

    with clock("engine start"):
        llm = make_llm(model_dir, str(device), args.dtype, args.max_loras, args.rank,
                       max_num_seqs=args.max_num_seqs, max_cpu_loras=args.max_cpu_loras,
                       max_num_batched_tokens=args.max_num_batched_tokens, seed=args.seed,
                       freeze_gc=not args.smoke,  # this process exists for the run (a smoke run may be a test's)
                       tensor_parallel_size=tp, **engine_kwargs(args, OFFLINE))
    with clock("engine warm-up"):
        # compiles kernels and fills allocator pools before anything is timed: the LoRA kernels are compiled per
        # launch configuration and per integer-argument specialization (token counts divisible by 16 or not),
        # so the warm-up runs the timed runs' step shapes (full-length prompts: full prefill steps, mixed
        # prefill + decode steps) with one adapter, with many, and without
        run_popularities(llm, ["identical", "distinct", "base"], min(64, args.num_requests), args.input_len, 8,
                         args.len_dist, shape.vocab_size, adapter_dirs, seed=args.seed + 99)

    if args.step_batch > 0 and tp > 1:
        # measure_decode_step drives rank 0's runner directly; the workers only follow steps the engine schedules
        log.warning("tensor_parallel_size %d: the decode-step timing (--step-batch) is skipped", tp)
    elif args.step_batch > 0:
        steps = result["decode_step"] = []
        with clock("decode step vs roofline"):
            for label, distinct in (("base", False), (f"{args.step_batch} distinct rank-{args.rank} adapters", True)):
                step = measure_decode_step(llm, args.step_batch, args.step_context, args.step_count,
                                           shape.vocab_size, adapter_dirs, distinct_adapters=distinct)
                ctx = round(step["mean_context"])
                ranks = [args.rank] * args.step_batch if distinct else []
                step_bytes = decode_step_bytes(shape, [ctx] * args.step_batch, ranks, elem_bytes=elem,
                                               kv_elem_bytes=kv_elem, weight_quant=quant)
                step["roofline"] = roofline(step_bytes, bandwidth, step["step_mean_s"])
                step["label"] = label
                steps.append(step)

    rank_of = adapter_rank_of(adapter_dirs)

    def floor(steps):
        return workload_floor(steps, shape, rank_of, elem, bandwidth, matmul_flops, kv_elem_bytes=kv_elem,
                              weight_quant=quant)

    rows = result["throughput"] = []
    repeats = max(1, getattr(args, "repeats", 1))
    for round_no in range(1, repeats + 1):  # rounds: each popularity once, ÷ that round's base
        for pop in args.popularity:
            with clock(f"offline {pop}" + (f" (round {round_no})" if repeats > 1 else "")):
                rows += run_popularities(llm, [pop], args.num_requests, args.input_len, args.output_len,
                                         args.len_dist, shape.vocab_size, adapter_dirs, seed=args.seed, floor=floor)
                rows[-1]["round"] = round_no
                add_over_base(rows)
                add_upload_time(rows[-1], shape.lora_params_per_rank() * args.rank * elem, h2d_bandwidth)

    llm.shutdown()  # stops tensor-parallel workers; nothing to stop otherwise
    del llm
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result, offline_sections(result)


def add_upload_time(row: dict, adapter_bytes: int, h2d_bandwidth: float) -> None:
    """A run's adapter uploads to GPU slots (its slot loads × one adapter's bytes) and their time at the measured
    host->device rate: a floor of its own for a run whose adapters churn (every distinct adapter is one upload),
    paid on the copy stream beside the steps."""
    loads = (row.get("diagnostics") or {}).get("engine", {}).get("lora_slot_loads")
    if loads is None:
        return
    row["diagnostics"]["adapter_upload_bytes"] = loads * adapter_bytes
    row["diagnostics"]["adapter_upload_s"] = loads * adapter_bytes / h2d_bandwidth


def offline_sections(result: dict) -> list[tuple[str, str]]:
    """The report's sections for whatever parts of the offline run ``result`` holds."""
    from loraplex.bench.sections import peer_section, step_section, throughput_section

    rows = result.get("throughput") or []
    sections = [throughput_section(rows)] if rows else []
    if result.get("decode_step"):
        sections.append(step_section(result["decode_step"]))
    if "peer" in result:
        sections.append(peer_section(result["peer"], rows))
    tp = (result.get("settings") or {}).get("tensor_parallel_size") or 1
    if tp > 1:
        sections.insert(0, ("Tensor parallelism", f"The engine ran over {tp} ranks (`--tensor-parallel-size {tp}`). "
                            f"Floors and rooflines count {tp}x GPU 0's measured copy bandwidth and matmul rate (each "
                            "rank moves 1/P of the projections and KV; replicated parts and all-reduces are not "
                            "counted, so the floors are optimistic); the single-runner decode-step timing was "
                            "skipped."))
    return sections
