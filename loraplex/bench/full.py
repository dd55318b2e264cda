"""``loraplex bench all``: every figure of issue 9 from one run, in one report with one command line.

Order: paged attention vs SDPA, the LoRA kernel microbenchmark (``loraplex.bench.lora_kernels``), with
``--online-rate`` the online run (a ``loraplex serve`` process on the same model, started and stopped by the
bench while no engine lives in this process), then the offline engine run (HF + PEFT peer first, then base and
each popularity, then the decode step vs its HBM floor). The report opens with every target next to its measured
figure, met or missed, and ends with the wall time of each part (also logged as each part ends).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import re
import tempfile
import time
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
        num_adapters=args.online_adapters, max_loras=args.max_loras, max_num_seqs=args.max_num_seqs,
        popularity="uniform", rate=args.online_rate, num_requests=args.online_requests,
        input_len=args.input_len, output_len=args.output_len, len_dist=args.len_dist, vocab_size=None,
        slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms, seed=args.seed,
        warmup_requests=args.online_warmup_requests, serve_env=list(getattr(args, "online_serve_env", None) or []))


class CutShort(BaseException):
    """SIGTERM during ``bench all`` (e.g. ``timeout`` before a hard time limit): report what has finished.
    A BaseException, like KeyboardInterrupt, so that no ``except Exception`` on the way (a failed request is
    counted and the run goes on) swallows it."""


def _cut_short(signum, frame):
    raise CutShort(f"signal {signum}")


def run_full(args, device: torch.device, out_dir: str | None) -> int:
    """Every part in one report. SIGTERM stops the run where it is and still writes the report of the parts that
    finished (the report says where it was cut); the exit code is then 3. The report is also rewritten after each
    part, so a run that dies without unwinding (H200 run 19: killed in an offline round) leaves what it measured."""
    import faulthandler
    import signal

    from loraplex.bench.report import environment, utc_stamp, write_report
    from loraplex.bench.timing import SectionClock

    started = time.perf_counter()
    stamp = utc_stamp()  # one pair of report files, rewritten after each part and at the end
    result: dict = {"environment": environment(device)}
    markdown: dict[str, str] = {}  # parts' own markdown that the report reuses (not in the JSON)

    def write(cut: dict | None):
        done = {**result, "section_wall_s": dict(clock.walls), "total_wall_s": time.perf_counter() - started}
        if cut:
            done["cut_short"] = cut
        return write_report("issue9", done, _sections(done, markdown), out_dir, args, stamp=stamp)

    def checkpoint(part: str) -> None:
        # if the process dies before the end (a crash, a kill) the files still hold every part that finished; a
        # copy that cannot be written (a part's figures not yet reportable) never stops the run
        try:
            write({"reason": "the run had not ended when this copy was written",
                   "after_s": time.perf_counter() - started, "part": f"the part after {part}"})
        except Exception:
            log.warning("bench all: no copy of the report after %s", part, exc_info=True)

    clock = SectionClock(log, "bench all", on_end=checkpoint)
    cut = None
    # a native crash, or SIGTERM, prints every thread's Python stack to stderr (SIGTERM then goes on to _cut_short)
    faulthandler.enable()
    previous = signal.signal(signal.SIGTERM, _cut_short)
    faulthandler.register(signal.SIGTERM, chain=True)
    try:
        _run_parts(args, device, clock, result, markdown)
    except CutShort as exc:
        cut = {"reason": str(exc), "after_s": time.perf_counter() - started, "part": clock.raised_in}
        log.warning("bench all: cut short by %s after %.0f s, in %s: writing the parts that finished",
                    exc, cut["after_s"], clock.raised_in)
    finally:
        faulthandler.unregister(signal.SIGTERM)
        signal.signal(signal.SIGTERM, previous)
    clock.on_end = None
    log.info("bench all: %.1f s in all", time.perf_counter() - started)
    json_path, md_path = write(cut)  # the last write: wall times as of now, and the cut if there was one
    print(md_path.read_text())
    print(f"wrote {json_path} and {md_path}")
    return 3 if cut else 0


def _run_parts(args, device: torch.device, clock, result: dict, markdown: dict[str, str]) -> None:
    from loraplex.bench.attention_bench import run_attention_bench
    from loraplex.bench.offline_run import collect_offline, prepare_model, smoke_settings
    from loraplex.bench.online import collect_online

    if args.smoke:
        smoke_settings(args)
        args.online_requests, args.online_adapters = min(args.online_requests, 8), min(args.online_adapters, 2)
    with clock("attention"):
        if args.smoke:
            result["attention"] = run_attention_bench(device, batch=2, contexts=(37,), dtype=torch.float32, iters=1,
                                                      warmup=0, prefill=None, num_q_heads=8, num_kv_heads=2,
                                                      head_dim=32)
        else:
            result["attention"] = run_attention_bench(device, batch=args.attn_batch, contexts=args.contexts,
                                                      iters=args.attn_iters, sweep=args.sweep)
    if not args.skip_lora_kernels:
        with clock("LoRA kernels"):
            lora = _lora_kernels(device, args.smoke, args.sweep)
        markdown["lora_kernels"] = lora.pop("markdown")
        result["lora_kernels"] = lora
    _release(device)  # the engines size their KV cache from free memory: hand back the allocator's cache
    if args.online_rate > 0:
        # before the offline engine exists, so the server process has the GPU to itself
        with clock("model files"):
            model_dir = prepare_model(args, device)
        _release(device)  # the weights were drawn on the GPU: the server sizes its KV cache from free memory
        with clock("online (launched loraplex serve)"):
            result["online"] = collect_online(_online_args(args, str(model_dir)), device)
    result["offline"] = {}
    collect_offline(args, device, clock, result["offline"])


def _sections(result: dict, markdown: dict[str, str]) -> list[tuple[str, str]]:
    from loraplex.bench.gaps import gaps_section
    from loraplex.bench.offline_run import offline_sections
    from loraplex.bench.sections import attention_section, online_section, targets_section, wall_time_section

    attn, lora, offline = result.get("attention"), result.get("lora_kernels"), result.get("offline") or {}
    sections = [targets_section(attn, lora, offline)]
    gaps = gaps_section(attn, lora, offline)
    if gaps:
        sections.append(gaps)
    cut = result.get("cut_short")
    if cut:
        sections.append(("Cut short", f"This run was stopped ({cut['reason']}) after {cut['after_s']:.0f} s, during "
                                      f"*{cut['part']}*: that part and the ones after it did not finish and are "
                                      "missing below; every figure shown is from a part that finished."))
    if attn:
        sections.append(attention_section(attn))
    if lora:
        # its title and command lines are replaced by this report's
        body = re.sub(r"\A#[^\n]*\n+Command:\n+```\n[^\n]*\n```\n+", "", markdown["lora_kernels"])
        sections.append(("LoRA shrink/expand microbenchmark", body.replace("\n## ", "\n### ")))
    sections += offline_sections(offline)
    if result.get("online"):
        sections.append(online_section(result["online"]))
    sections.append(wall_time_section(result["section_wall_s"], result["total_wall_s"]))
    return sections
