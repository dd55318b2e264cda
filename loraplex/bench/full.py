"""``loraplex bench all``: every figure of issue 9 from one run, in one report with one command line.

Order: paged attention vs SDPA, the LoRA kernel microbenchmark (``loraplex.bench.lora_kernels``), then the
offline engine run (HF + PEFT peer first, then base and each popularity, then the decode step vs its
HBM floor). The report opens with every target next to its measured figure, met or missed.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import re
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)


def _lora_kernels(device: torch.device, smoke: bool, sweep: bool) -> dict:
    from loraplex.bench import lora_kernels

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "lora_kernels.json"
        argv = ["--out", str(out), "--device", str(device)] + (["--smoke"] if smoke else [])
        argv += ["--sweep"] if sweep and not smoke else []
        lora_kernels.main(argv)
        payload = json.loads(out.read_text())
        payload["markdown"] = out.with_suffix(".md").read_text()
    return payload


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _online_args(args, model_dir: str) -> argparse.Namespace:
    """The online run of ``bench all``: a server launched on the same model, uniform popularity."""
    return argparse.Namespace(
        launch=True, model_dir=model_dir, model=None, adapters="", url=None, api_key=None, smoke=args.smoke,
        work_dir=args.work_dir, layers=args.layers, dtype=args.dtype, rank=args.rank,
        num_adapters=args.num_adapter_files, max_loras=args.max_loras, max_num_seqs=args.max_num_seqs,
        popularity="uniform", rate=args.online_rate, num_requests=args.online_requests,
        input_len=args.input_len, output_len=args.output_len, len_dist=args.len_dist, vocab_size=None,
        slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms, seed=args.seed)


def run_full(args, device: torch.device, out_dir: str | None) -> int:
    from loraplex.bench.attention_bench import run_attention_bench
    from loraplex.bench.offline_run import collect_offline
    from loraplex.bench.online import collect_online
    from loraplex.bench.report import environment, write_report
    from loraplex.bench.sections import attention_section, online_section, targets_section

    result: dict = {"environment": environment(device)}
    sections = []
    if args.smoke:
        attn = run_attention_bench(device, batch=2, contexts=(37,), dtype=torch.float32, iters=1, warmup=0,
                                   prefill=None, num_q_heads=8, num_kv_heads=2, head_dim=32)
    else:
        attn = run_attention_bench(device, batch=args.attn_batch, contexts=args.contexts, iters=args.attn_iters,
                                   sweep=args.sweep)
    result["attention"] = attn
    sections.append(attention_section(attn))

    lora = None
    if not args.skip_lora_kernels:
        lora = _lora_kernels(device, args.smoke, args.sweep)
        result["lora_kernels"] = {k: v for k, v in lora.items() if k != "markdown"}
        # its title and command lines are replaced by this report's
        body = re.sub(r"\A#[^\n]*\n+Command:\n+```\n[^\n]*\n```\n+", "", lora["markdown"])
        sections.append(("LoRA shrink/expand microbenchmark", body.replace("\n## ", "\n### ")))

    _release(device)  # the engine sizes its KV cache from free memory: hand back the allocator's cache
    offline, offline_sections = collect_offline(args, device)
    result["offline"] = offline
    sections += offline_sections

    if args.online_rate > 0:
        online = collect_online(_online_args(args, offline["model_dir"]), device)
        result["online"] = online
        sections.append(online_section(online))
    sections.insert(0, targets_section(attn, lora, offline))
    json_path, md_path = write_report("issue9", result, sections, out_dir, args)
    print(md_path.read_text())
    print(f"wrote {json_path} and {md_path}")
    return 0
