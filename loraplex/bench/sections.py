"""Markdown sections of the benchmark reports, each next to the issue's target for that figure."""

from __future__ import annotations

import statistics

from loraplex.bench.offline import summarize_rounds
from loraplex.bench.report import table

# multi-LoRA throughput ÷ base throughput on the same workload (issue 9)
OVER_BASE_TARGETS = {"identical": 0.97, "zipf": 0.93, "uniform": 0.90, "distinct": 0.80}
STEP_OVER_FLOOR_TARGET = 1.3
PEER_SPEEDUP_TARGET = 100.0
ATTENTION_SPEED_TARGET = 0.85


def _ms(seconds):
    return None if seconds is None else seconds * 1e3


def _meets(value, target, higher_is_better: bool = True):
    if value is None or target is None:
        return None
    return value >= target if higher_is_better else value <= target


# base rounds whose output tok/s spread more than this (max - min over the median) leave the ÷ base figures unjudged
BASE_SPREAD_WARN = 0.05
NOT_JUDGED = "not judged (noisy base)"


def over_base_meets(summary: list[dict], row: dict, target):
    """``_meets`` for a ÷ base figure, unless the base rounds alone spread more than ``BASE_SPREAD_WARN``: then the
    machine's noise is as large as the gaps being judged (a slow base round lifts every ratio of its round), so the
    figure is reported as measured and judged ``NOT_JUDGED``."""
    if target is None or row.get("over_base") is None:
        return None
    spread = base_spread(summary)
    if spread and spread[0] > BASE_SPREAD_WARN:
        return NOT_JUDGED
    return _meets(row["over_base"], target)


def base_spread(summary: list[dict]) -> tuple[float, float, float] | None:
    """(spread, min, max) of the base rounds' output tok/s, spread = (max - min) / median; None with one round."""
    base = next((r for r in summary if r["popularity"] == "base" and r.get("rounds", 1) > 1), None)
    if base is None:
        return None
    runs = base["output_tok_per_s_rounds"]
    lo, hi = min(runs), max(runs)
    return (hi - lo) / statistics.median(runs), lo, hi


def attention_section(result: dict) -> tuple[str, str]:
    rows = []
    for r in result["decode"]:
        best = r.get("sweep_best") or {}
        rows.append({
            **r, "paged_us": r["paged_s"] * 1e6, "sdpa_us": r["sdpa_s"] * 1e6,
            "best_us": best.get("paged_s", 0) * 1e6 if best else None,
            "best_cfg": ", ".join(f"{k}={best[k]}" for k in ("num_splits", "block_n", "num_warps", "num_stages")
                                  if k in best) or None,
            "meets": _meets(r["paged_over_sdpa_speed"], ATTENTION_SPEED_TARGET),
        })
    body = table(rows, [
        ("batch", "batch"), ("context", "context"), ("num_splits", "splits"), ("paged_us", "paged µs"),
        ("sdpa_us", "SDPA µs"), ("paged_over_sdpa_speed", "paged speed ÷ SDPA"), ("meets", f"≥ {ATTENTION_SPEED_TARGET}"),
        ("paged_GBps", "paged GB/s"), ("paged_frac_copy_bw", "paged ÷ copy BW"),
        ("sdpa_frac_copy_bw", "SDPA ÷ copy BW"), ("max_abs_err_vs_sdpa", "max abs err vs SDPA"),
        ("best_us", "best swept µs"), ("best_cfg", "best config"),
    ])
    bw = result["copy_bandwidth_Bps"] / 1e12
    intro = (f"Measured device copy bandwidth (read + write): {bw:.2f} TB/s. KV bytes per call = "
             "2 · batch · context · Hkv · D · 2 B; the paged kernel reads blocks in random order.")
    fp8 = [r for r in result["decode"] if "paged_fp8_s" in r]
    if fp8:
        rows = [{**r, "fp8_us": r["paged_fp8_s"] * 1e6, "paged_us": r["paged_s"] * 1e6,
                 "fp8_best_us": r["fp8_sweep_best"]["paged_s"] * 1e6 if r.get("fp8_sweep_best") else None,
                 "fp8_best_cfg": ", ".join(f"{k}={v}" for k, v in (r.get("fp8_sweep_best") or {}).items()
                                           if k not in ("paged_s", "max_abs_err_vs_sdpa"))} for r in fp8]
        swept = [("fp8_best_us", "fp8 best swept µs"), ("fp8_best_over_sdpa_speed", "best fp8 ÷ SDPA"),
                 ("fp8_best_cfg", "best fp8 config")] if any(r.get("fp8_sweep_best") for r in fp8) else []
        body += ("\n\nThe same decode cases over a float8 e4m3 cache (`kv_cache_dtype=\"fp8\"`: one byte per cached value, half of bf16; "
                 "SDPA still reads the 16-bit K/V):\n\n") + table(rows, [
            ("batch", "batch"), ("context", "context"), ("fp8_us", "paged fp8 µs"), ("paged_us", "paged 16-bit µs"),
            ("paged_fp8_over_paged_speed", "fp8 speed ÷ 16-bit"), ("paged_fp8_over_sdpa_speed", "fp8 speed ÷ SDPA"),
            ("paged_fp8_frac_copy_bw", "fp8 bytes ÷ copy BW"), ("fp8_max_abs_err_vs_sdpa", "max abs err vs SDPA"),
            *swept])
    if result.get("prefill"):
        rows = [{**r, "paged_ms": r["paged_s"] * 1e3, "sdpa_ms": r["sdpa_s"] * 1e3} for r in result["prefill"]]
        body += "\n\nFresh causal prefill (no target; for reference), same layouts:\n\n" + table(rows, [
            ("num_seqs", "sequences"), ("query_len", "tokens each"), ("paged_ms", "paged ms"), ("sdpa_ms", "SDPA ms"),
            ("paged_over_sdpa_speed", "paged speed ÷ SDPA"), ("paged_TFLOPs", "paged TFLOP/s"),
            ("sdpa_TFLOPs", "SDPA TFLOP/s"), ("max_abs_err_vs_sdpa", "max abs err vs SDPA")])
    return "Paged attention vs torch SDPA(enable_gqa=True), contiguous KV", intro + "\n\n" + body


def throughput_section(rows: list[dict]) -> tuple[str, str]:
    all_rows, rows = rows, summarize_rounds(rows)
    out = []
    for r in rows:
        target = OVER_BASE_TARGETS.get(r["popularity"])
        roof = r.get("roofline") or {}
        out.append({**r, "target": target, "meets": over_base_meets(rows, r, target),
                    "floor_s": roof.get("floor_s"), "adapters_per_step": roof.get("mean_decode_adapters"),
                    "batch": roof.get("mean_decode_batch")})
    body = table(out, [
        ("popularity", "popularity"), ("num_adapters", "adapters"), ("num_requests", "requests"),
        ("prompt_tokens", "prompt tokens"), ("output_tokens", "output tokens"), ("elapsed_s", "wall s"),
        ("output_tok_per_s", "output tok/s"), ("total_tok_per_s", "total tok/s"),
        ("over_base", "÷ base"), ("roofline_over_base", "roofline ÷ base"), ("target", "target"), ("meets", "meets"),
        ("hbm_roofline_over_base", "HBM-only ÷ base"), ("floor_s", "floor s"), ("wall_over_floor", "wall ÷ floor"),
        ("batch", "mean decode batch"), ("adapters_per_step", "adapters / decode step"),
    ])
    note = roofline_note(rows)
    split = time_split_table(all_rows)
    return ("Offline throughput by adapter popularity",
            rounds_table(rows) + body + ("\n\n" + note if note else "") + split)


def rounds_table(summary: list[dict]) -> str:
    """With several rounds: each popularity's ÷ base in every round (each against its own round's base) and the
    spread; the table below it then shows the median round."""
    n = max((r.get("rounds", 1) for r in summary), default=1)
    if n == 1:
        return ""
    out = []
    for r in summary:
        row = {"popularity": r["popularity"], "median": r.get("over_base"), "min": r.get("over_base_min"),
               "max": r.get("over_base_max")}
        for i, v in enumerate(r.get("over_base_rounds") or [], 1):
            row[f"r{i}"] = v
        for i, v in enumerate(r["output_tok_per_s_rounds"], 1):
            row[f"t{i}"] = v
        out.append(row)
    columns = [("popularity", "popularity")] + [(f"r{i}", f"÷ base, round {i}") for i in range(1, n + 1)] + [
        ("median", "median"), ("min", "min"), ("max", "max")] + [(f"t{i}", f"tok/s, round {i}") for i in range(1, n + 1)]
    text = (f"{n} rounds of the popularity list in one engine, each ratio against its own round's base run; below, "
            "the median round of each popularity (targets are judged on it):\n\n" + table(out, columns) + "\n\n")
    spread = base_spread(summary)
    if spread and spread[0] > BASE_SPREAD_WARN:
        text += (f"**Noisy machine:** the base rounds alone spread by {spread[0]:.0%} ({spread[1]:,.0f}–{spread[2]:,.0f} "
                 f"output tok/s), more than {BASE_SPREAD_WARN:.0%}: as much as the gaps being judged, and a ratio moves "
                 f"with its round's base run. The ÷ base targets are marked \"{NOT_JUDGED}\".\n\n")
    return text


def per_step_ms(seconds, steps):
    """``seconds`` over ``steps`` in ms; None without steps or seconds."""
    return 1e3 * seconds / steps if seconds is not None and steps else None


def time_split_table(rows: list[dict]) -> str:
    """Each run's wall time by step kind and the Triton compiles inside it (runs recorded with diagnostics)."""
    out = []
    for r in rows:
        d = r.get("diagnostics")
        if not d:
            continue
        eng = d.get("engine", {})
        out.append({"popularity": r["popularity"] + (f" ({r['round']})" if r.get("round", 1) > 1 else ""),
                    **d, **{f"engine_{k}": v for k, v in eng.items()},
                    "decode_ms": per_step_ms(d["decode_s"], d["decode_steps"]),
                    "prefill_ms": per_step_ms(d["prefill_s"], d["prefill_steps"]),
                    "upload_gb": d["adapter_upload_bytes"] / 1e9 if "adapter_upload_bytes" in d else None,
                    "decode_wait_ms": per_step_ms(d.get("decode_wait_s"), d["decode_steps"]),
                    "prefill_wait_ms": per_step_ms(d.get("prefill_wait_s"), d["prefill_steps"])})
    if not out:
        return ""
    return ("\n\nWhere each run's wall time went (time from one step's scheduling to the next's, by step kind; "
            "\"compiles\": Triton kernel variants compiled inside the timed window; \"upload GB\": slot loads × one "
            "adapter's bytes, and \"at H2D s\" their time at the measured pinned host->device rate, a floor of its "
            "own beside the HBM one when adapters churn; \"host probe ms\": a fixed pure-Python loop timed right "
            "after the run, and the 1-minute load average: a slower host shows there; \"waiting ms\": per step of each kind, the engine's "
            "time blocked on the device's sampled tokens: steps that seldom wait ran at the host's pace, not the "
            "GPU's; \"SM MHz\", \"power W\": what nvidia-smi reported every 200 ms during the run):\n\n" + table(out, [
                ("popularity", "popularity"), ("decode_steps", "decode steps"), ("decode_s", "decode s"),
                ("decode_ms", "ms / decode step"),
                ("decode_wait_ms", "waiting ms / decode step"), ("prefill_steps", "steps with prompt tokens"),
                ("prefill_s", "their s"), ("prefill_ms", "ms / such step"),
                ("prefill_wait_ms", "waiting ms / such step"), ("triton_compiles", "compiles"),
                ("engine_num_overlapped_steps", "overlapped steps"),
                ("engine_num_piecewise_graph_steps", "piecewise-graph steps"), ("engine_num_preemptions", "preemptions"),
                ("engine_num_adapter_wait_steps", "steps idle for adapter reads"),
                ("engine_adapter_wait_seconds", "their s"), ("engine_lora_host_loads", "adapter file reads"),
                ("engine_lora_host_load_seconds", "read s"), ("engine_lora_slot_loads", "slot loads"),
                ("upload_gb", "upload GB"), ("adapter_upload_s", "at H2D s"), ("engine_lora_merges", "merges"),
                ("engine_lora_merged_steps", "merged steps"), ("sm_clock_mhz_mean", "SM MHz mean"),
                ("sm_clock_mhz_min", "SM MHz min"), ("power_w_mean", "power W"), ("host_probe_ms", "host probe ms"),
                ("load_1m", "load 1m")]) + compiled_note(rows))


def compiled_note(rows: list[dict]) -> str:
    """The kernels that Triton compiled inside each timed run (their keys are in the JSON), and the runs done again
    because of it (``run_popularities``), or nothing."""
    def names(variants):
        return ", ".join(sorted({v.split(": ", 1)[0].rsplit(".", 1)[-1] for v in variants}))

    def label(r):
        return r["popularity"] + (f" ({r['round']})" if r.get("round", 1) > 1 else "")

    named = [f"{label(r)}: {names(r['diagnostics']['triton_compiled'])}" for r in rows
             if (r.get("diagnostics") or {}).get("triton_compiled")]
    again = [f"{label(r)} ({r['discarded_run']['elapsed_s']:.2f} s, compiled {names(r['discarded_run']['triton_compiled'])})"
             for r in rows if r.get("discarded_run")]
    text = ""
    if named:
        text += ("\n\nKernels compiled inside the timed window (specialization keys in the JSON, "
                 "diagnostics.triton_compiled): " + "; ".join(named) + ".")
    if again:
        text += ("\n\nRuns timed again because Triton compiled a kernel inside their first timed window (the "
                 "warm-up missed a variant; the first run is in the JSON as discarded_run, not in any figure): "
                 + "; ".join(again) + ".")
    return text


def roofline_note(rows: list[dict]) -> str:
    """What the roofline column means, and which ÷ base targets the HBM bandwidth rules out for these runs."""
    if not any(r.get("roofline_over_base") for r in rows):
        return ""
    text = ("\"roofline ÷ base\" is the ÷ base ratio that the hardware allows for the same workload: each run's "
            "floor is summed over the engine steps it actually ran, each step taking at least its HBM time (all base "
            "weights, the A and B of each distinct adapter in the step at its real rank, the KV of every sequence's "
            "context, ÷ the measured copy bandwidth) and at least its compute time (every token through every "
            "projection, sampled rows through the LM head, ÷ the measured bf16 matrix-product rate: prefill is "
            "compute-bound); the ratio is the base run's floor time per output token ÷ this run's, i.e. the ÷ base "
            "ratio with both runs at their floors. \"HBM-only ÷ base\" is the same from the bytes alone. A target "
            "above the roofline ratio can be met only while the base run stays correspondingly far above its own "
            "floor (its wall ÷ floor is in the table), whatever the kernels do.")
    over = [f"{r['popularity']} (target {OVER_BASE_TARGETS[r['popularity']]:g}; the roofline allows "
            f"{r['roofline_over_base']:.2f} at a mean of {r['roofline']['mean_decode_adapters']:.1f} distinct "
            f"adapters and {r['roofline']['mean_decode_batch']:.0f} sequences per decode step)" for r in rows
            if r.get("roofline_over_base") and r["popularity"] in OVER_BASE_TARGETS
            and r["roofline_over_base"] < OVER_BASE_TARGETS[r["popularity"]]]
    if over:
        text += " Targets above the roofline here: " + "; ".join(over) + "."
    else:
        text += " Every ÷ base target is within its roofline here."
    return text


def step_section(rows: list[dict]) -> tuple[str, str]:
    out = []
    for r in rows:
        roof = r["roofline"]
        out.append({
            **r, "step_ms": _ms(r["step_mean_s"]), "median_ms": _ms(r["step_median_s"]),
            "floor_ms": _ms(roof["floor_s"]), "over_floor": roof["measured_over_floor"],
            "weights_gb": roof["weights"] / 1e9, "lora_gb": roof["lora"] / 1e9, "kv_gb": roof["kv"] / 1e9,
            "meets": _meets(roof["measured_over_floor"], STEP_OVER_FLOOR_TARGET, higher_is_better=False),
        })
    body = table(out, [
        ("label", "step"), ("batch", "batch"), ("mean_context", "mean context"), ("num_adapters", "adapters"),
        ("step_ms", "mean ms"), ("median_ms", "median ms"), ("weights_gb", "weights GB"), ("lora_gb", "LoRA GB"),
        ("kv_gb", "KV GB"), ("floor_ms", "HBM floor ms"), ("over_floor", "measured ÷ floor"),
        ("meets", f"≤ {STEP_OVER_FLOOR_TARGET}"),
    ])
    note = ("Floor = (weights + active LoRA weights + KV read) ÷ measured copy bandwidth. The step time is the "
            "engine's whole step (scheduling, batch preparation, forward, sampling), timed with all sequences "
            "decoding.")
    return "Decode step vs HBM roofline", note + "\n\n" + body


def peer_section(peer: dict, rows: list[dict]) -> tuple[str, str]:
    ours = {r["popularity"]: r["output_tok_per_s"] for r in summarize_rounds(rows)}
    out = []
    for pop in ("uniform", "distinct", "zipf", "identical", "base"):
        if pop in ours and peer.get("output_tok_per_s"):
            speedup = ours[pop] / peer["output_tok_per_s"]
            out.append({"popularity": pop, "loraplex": ours[pop], "peer": peer["output_tok_per_s"],
                        "speedup": speedup, "meets": _meets(speedup, PEER_SPEEDUP_TARGET)})
    intro = (f"HF transformers + PEFT mixed-adapter generate: {peer['num_requests']} requests in batches of "
             f"{peer['batch_size']}, {peer['num_adapters']} adapters (row i uses adapter i mod n), "
             f"{peer['input_len']} prompt / {peer['output_len']} output tokens, "
             f"{peer.get('output_tok_per_s') or 0:.1f} output tok/s.")
    body = table(out, [("popularity", "loraplex workload"), ("loraplex", "loraplex tok/s"), ("peer", "peer tok/s"),
                       ("speedup", "speedup"), ("meets", f"≥ {PEER_SPEEDUP_TARGET:g}×")])
    return "Peer: Hugging Face transformers + PEFT", intro + "\n\n" + body


def online_section(result: dict) -> tuple[str, str]:
    s = result["summary"]
    rows = []
    for key, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"), ("e2e_s", "E2E")):
        d = s[key]
        rows.append({"metric": label, "mean": _ms(d["mean"]), "p50": _ms(d["p50"]), "p90": _ms(d["p90"]),
                     "p99": _ms(d["p99"]), "count": d["count"]})
    intro = (f"Poisson arrivals at {result['rate']} req/s, {s['num_requests']} requests "
             f"({s['completed']} completed, {s['failed']} failed), popularity {result['popularity']}, "
             f"{result['input_len']} prompt / {result['output_len']} output tokens"
             + (f", after {result['warmup_requests']} warm-up requests (not counted)" if result.get("warmup_requests")
                else "") + ". "
             f"Output throughput {s['output_tok_per_s'] or 0:.1f} tok/s; goodput "
             f"{s['goodput_req_per_s'] or 0:.2f} req/s within TTFT ≤ {s['slo_ttft_s'] * 1e3:g} ms and "
             f"TPOT ≤ {s['slo_tpot_s'] * 1e3:g} ms.")
    body = table(rows, [("metric", "latency (ms)"), ("mean", "mean"), ("p50", "p50"), ("p90", "p90"),
                        ("p99", "p99"), ("count", "samples")])
    server = result.get("server")
    if server:
        store = (f"SQLite file in its own data dir ({server.get('num_adapters', 0)} adapters, "
                 f"{server.get('num_usage_records', 0)} usage records after the run)" if server.get("sqlite_file")
                 else "no SQLite file found in its data dir")
        intro += (f"\n\nServer: `loraplex serve` started by the bench on the same model with the embedded default "
                  f"(no database or Redis URL: {store}; in-process cache and limiter), ready in "
                  f"{server.get('start_s', 0):.1f} s"
                  + (f", {len(result['adapters'])} adapters uploaded through the API in {server['upload_s']:.1f} s"
                     if "upload_s" in server else "")
                  + f"; stopped with SIGTERM, exit code {server['exit_code']} after {server['stop_s']:.1f} s"
                  + (" (killed: it did not drain in time)" if server.get("killed") else "") + ".")
    loop = result.get("engine_loop")
    if loop and loop.get("steps"):
        mode = {"process": " (in a process of its own)", "thread": " (in a thread of the server)"}.get(
            (server or {}).get("engine_mode"), "")
        intro += (f"\n\nThe server's engine loop{mode} during the run (its /metrics counters): {loop['steps']:,} "
                  f"steps, {loop['steps_per_s']:.1f} per s; {loop['step_ms']:.2f} ms per step inside the engine's step "
                  + (f"(the loop on a CPU {loop['step_cpu_ms']:.2f} ms, which on a GPU includes its "
                     f"{loop['device_wait_ms']:.2f} ms of waiting for the device, since CUDA's waits spin; off a CPU "
                     f"{loop['other_wait_ms']:.2f} ms: the GIL, in a thread of the server, or the OS) "
                     if loop.get("step_cpu_ms") is not None else "")
                  + f"and {loop['dispatch_ms']:.2f} ms handing out its deltas; busy {loop['busy_share']:.0%} of the run."
                  + (f" {loop['seqs_per_step']:.1f} sequences per step on average; "
                     f"{loop['prompt_step_share']:.0%} of the steps carried prompt chunks (no decode CUDA graph)."
                     if loop.get("seqs_per_step") is not None else ""))
    if result.get("serve_env"):
        intro += " Server settings given: " + ", ".join(f"`{e}`" for e in result["serve_env"]) + "."
    if s.get("failed") and s.get("errors"):
        intro += (f" The failed requests' errors ({len(s['errors'])} distinct shown): "
                  + "; ".join(f"`{e[:160]}`" for e in s["errors"]) + ".")
    return "Online serving", intro + "\n\n" + body


def wall_time_section(walls: dict[str, float], total_s: float) -> tuple[str, str]:
    rows = [{"section": name, "wall_s": s, "share": s / total_s if total_s else None} for name, s in walls.items()]
    rows.append({"section": "**whole run**", "wall_s": total_s, "share": 1.0})
    return "Wall time by part", table(rows, [("section", "part"), ("wall_s", "wall s"), ("share", "share")])


LORA_BW_TARGET = 0.70
LORA_STEP_TARGET_MS = 2.0


def target_rows(attn: dict | None, lora: dict | None, offline: dict | None) -> list[dict]:
    """Each issue-9 target with its measured figure (None where that part did not run)."""
    rows = []

    def add(name, measured, target, higher_is_better=True, note=""):
        rows.append({"target": name, "measured": measured, "goal": ("≥ " if higher_is_better else "≤ ") + f"{target:g}",
                     "meets": _meets(measured, target, higher_is_better), "note": note,
                     "target_value": target, "higher_is_better": higher_is_better})

    steps = (offline or {}).get("decode_step") or []
    base_step = next((s for s in steps if s["num_adapters"] == 0), None)
    if base_step:
        add(f"decode step ÷ HBM floor (batch {base_step['batch']}, context ~{base_step['prompt_len']:,})",
            base_step["roofline"]["measured_over_floor"],
            STEP_OVER_FLOOR_TARGET, higher_is_better=False,
            note=f"{base_step['step_mean_s'] * 1e3:.2f} ms vs floor {base_step['roofline']['floor_s'] * 1e3:.2f} ms")
    summary = summarize_rounds((offline or {}).get("throughput") or [])
    through = {r["popularity"]: r for r in summary}
    noise = base_spread(summary)
    for pop, target in OVER_BASE_TARGETS.items():
        if pop in through and through[pop].get("over_base") is not None:
            r = through[pop]
            roof = r.get("roofline_over_base")
            spread = (f"; median of {r['rounds']} rounds ({r['over_base_min']:.3g}–{r['over_base_max']:.3g})"
                      if r.get("rounds", 1) > 1 and "over_base_min" in r else "")
            if noise and noise[0] > BASE_SPREAD_WARN:
                spread += f"; the base rounds alone spread {noise[0]:.0%}"
            add(f"multi-LoRA ÷ base throughput, {pop}", r["over_base"], target,
                note=f"{r['output_tok_per_s']:,.0f} output tok/s" + (f"; roofline ÷ base {roof:.3g}" if roof else "")
                     + spread)
            rows[-1]["meets"] = over_base_meets(summary, r, target)
    peer = (offline or {}).get("peer")
    if peer and peer.get("output_tok_per_s"):
        for pop in ("uniform", "distinct"):
            if pop in through:
                add(f"speedup over HF + PEFT ({pop} workload)", through[pop]["output_tok_per_s"] / peer["output_tok_per_s"],
                    PEER_SPEEDUP_TARGET, note=f"peer {peer['output_tok_per_s']:.1f} tok/s")
    for r in (attn or {}).get("decode") or []:
        add(f"paged decode attention speed ÷ SDPA (batch {r['batch']}, context {r['context']})",
            r["paged_over_sdpa_speed"], ATTENTION_SPEED_TARGET,
            note=f"{r['paged_frac_copy_bw']:.0%} of copy BW (SDPA {r['sdpa_frac_copy_bw']:.0%})")
    # per kernel inside the engine's decode graph (profiler durations, 64 distinct adapters): the do_bench table
    # of the same report includes host launch time in each short kernel's figure. With programmatic dependent
    # launch a kernel starts before its predecessor ends and waits, so its duration is not its own: the policy
    # with PDL off gives the clean per-kernel figure when it was measured
    policy, in_graph = in_graph_kernels(lora)
    if in_graph:
        worst = min(in_graph, key=lambda k: k["pct_copy_bw"])
        best = max(in_graph, key=lambda k: k["pct_copy_bw"])
        add(f"LoRA shrink/expand ÷ copy BW, decode rank 16, in the graph ({policy}, worst kernel)",
            worst["pct_copy_bw"] / 100,
            LORA_BW_TARGET, note=f"{worst['kernel']} {worst['proj']}: {worst['us']:.1f} µs; best {best['kernel']} "
                                 f"{best['proj']} {best['pct_copy_bw']:.0f} %")
    else:
        decode_kernels = [k for k in (lora or {}).get("kernels") or [] if k["regime"] == "decode" and k["rank"] == 16]
        if decode_kernels:
            worst = min(decode_kernels, key=lambda k: k["pct_copy_bw"])
            add("LoRA shrink/expand ÷ copy BW, decode rank 16 (worst kernel, do_bench)", worst["pct_copy_bw"] / 100,
                LORA_BW_TARGET, note=f"{worst['kernel']} {worst['proj']}: {worst['time_us']:.1f} µs")
    if lora and lora.get("decode_step"):
        step = lora["decode_step"]
        add("all LoRA work of one decode step, 64 tokens on 64 distinct rank-16 adapters (ms)", step["time_ms"],
            LORA_STEP_TARGET_MS, higher_is_better=False, note=f"floor {step['floor_ms']:.3f} ms")
    # the same LoRA work between the base GEMMs (the engine's arrangement): time it adds to the projections
    for r in ((lora or {}).get("in_layer") or {}).get("rows") or []:
        if r["mix"] == "distinct":
            add(f"time LoRA adds to the base projections of a decode step, 64 distinct adapters, {r['policy']} "
                "(ms; for reference, the target row is the one above)", r["added_ms"], LORA_STEP_TARGET_MS,
                higher_is_better=False, note=f"step {r['time_ms']:.3f} ms; LoRA floor {r['lora_floor_ms']:.3f} ms")
    return rows


def in_graph_kernels(lora: dict | None) -> tuple[str, list[dict]]:
    """(policy, rows) of the per-kernel profile inside the decode graph, 64 distinct adapters: the policy with PDL
    off where it was measured (clean per-kernel durations), else the default."""
    graph_rows = ((lora or {}).get("decode_steps") or {}).get("kernels") or []
    policy = "no-pdl" if "no-pdl" in {k.get("policy") for k in graph_rows} else "default"
    return policy, [k for k in graph_rows if k.get("policy") == policy and k.get("mix") == "distinct"]


def targets_section(attn: dict | None, lora: dict | None, offline: dict | None) -> tuple[str, str]:
    rows = target_rows(attn, lora, offline)
    body = table(rows, [("target", "target"), ("measured", "measured"), ("goal", "goal"), ("meets", "met"),
                        ("note", "detail")])
    return "Targets (issue 9)", body
