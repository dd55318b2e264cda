"""The report's "Gaps that remain": for each issue-9 target this run missed (or could not judge), what the gap is made
of, computed from the run's own figures: the same-round base run, the step-time split by kind, the adapter bytes per
decode step at the measured copy bandwidth, the roofline, the per-kernel profile. Numbers only; no verdict beyond
what they show."""

from __future__ import annotations

from loraplex.bench.launch_floor import stand_in_ms
from loraplex.bench.offline import summarize_rounds
from loraplex.bench.roofline import ModelShape
from loraplex.bench.sections import (
    LORA_STEP_TARGET_MS,
    OVER_BASE_TARGETS,
    in_graph_kernels,
    per_step_ms,
    target_rows,
)

_ELEM_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def _missed(row: dict) -> bool:
    """Missed, or not judged (a noisy machine) with the figure as measured on the wrong side of the goal."""
    if row["meets"] is False:
        return True
    if isinstance(row["meets"], str) and row["measured"] is not None:
        goal = row["target_value"]
        return row["measured"] < goal if row["higher_is_better"] else row["measured"] > goal
    return False


def _same_round_base(runs: list[dict], row: dict) -> dict | None:
    return next((r for r in runs if r["popularity"] == "base" and r.get("round", 1) == row.get("round", 1)), None)


def _step_ms(d: dict, kind: str) -> float | None:
    return per_step_ms(d.get(f"{kind}_s"), d.get(f"{kind}_steps"))


def over_base_gap(pop: str, row: dict, base: dict, offline: dict) -> str:
    """Where a popularity's wall time over its round's base run went: decode and prompt steps, against the adapter
    bytes each decode step reads and the projection outputs a prompt step's LoRA work writes and reads again."""
    target = OVER_BASE_TARGETS[pop]
    wall, base_wall = row["elapsed_s"], base["elapsed_s"]
    cut = wall - base_wall * row["output_tokens"] / base["output_tokens"] / target
    parts = [f"**{pop}** ({row['over_base']:.3f} against {target:g}, round {row.get('round', 1)}): {wall:.2f} s "
             f"against the base run's {base_wall:.2f} s; meeting the target needs {cut:.2f} s less."]
    d, db = row.get("diagnostics") or {}, base.get("diagnostics") or {}
    bandwidth = offline.get("copy_bandwidth_Bps")
    settings = offline.get("settings") or {}
    roof = row.get("roofline") or {}
    shape = ModelShape(**offline["model_shape"]) if offline.get("model_shape") else None
    elem = _ELEM_BYTES.get(settings.get("dtype") or "bfloat16", 2)
    if d.get("decode_steps") and db.get("decode_steps"):
        ms, base_ms = _step_ms(d, "decode"), _step_ms(db, "decode")
        extra = ms - base_ms
        total = d["decode_s"] - db["decode_s"]
        text = (f"Decode steps: {extra:+.2f} ms each ({ms:.2f} against {base_ms:.2f}), {total:+.2f} s over "
                f"{d['decode_steps']} steps")
        adapters = roof.get("mean_decode_adapters")
        if shape and bandwidth and adapters and settings.get("rank"):
            per_adapter = shape.lora_params_per_rank() * settings["rank"] * elem
            floor_ms = 1e3 * adapters * per_adapter / bandwidth
            text += (f"; the {adapters:.1f} adapters of a mean decode step hold {adapters * per_adapter / 1e9:.2f} GB, "
                     f"{floor_ms:.2f} ms at the copy bandwidth")
            if extra > 0:
                text += f", so the LoRA work of a decode step ran at {floor_ms / extra:.0%} of it"
        parts.append(text + ".")
    if d.get("prefill_steps") and db.get("prefill_steps"):
        extra = _step_ms(d, "prefill") - _step_ms(db, "prefill")
        total = d["prefill_s"] - db["prefill_s"]
        text = (f"Steps with prompt tokens: {extra:+.1f} ms each, {total:+.2f} s over {d['prefill_steps']} "
                "steps")
        if shape and bandwidth and row.get("prompt_tokens"):
            # every projection output of a token, over the layers
            outputs = shape.num_layers * sum(out for _, out in shape.proj_dims().values())
            tokens = row["prompt_tokens"] / d["prefill_steps"]
            traffic_ms = 1e3 * tokens * outputs * elem * 2 / bandwidth
            text += (f"; at {tokens:,.0f} prompt tokens a step, adding the delta to outputs that the base GEMM also "
                     f"writes costs at least one more write and one more read of every projection's output (either "
                     f"LoRA order): {traffic_ms:.1f} ms at the copy bandwidth")
        parts.append(text + ".")
    ratio = row.get("roofline_over_base")
    if ratio:
        if ratio < target:
            parts.append(f"The roofline allows {ratio:.3f} for this workload: the target is above it, reachable only "
                         f"while the base run stays far above its own floor (wall ÷ floor {base.get('wall_over_floor', 0):.2f}).")
        else:
            parts.append(f"The roofline allows {ratio:.3f}; the run's ratio is {row['over_base'] / ratio:.0%} of that.")
    return " ".join(parts)


def gaps_section(attn: dict | None, lora: dict | None, offline: dict | None) -> tuple[str, str] | None:
    """("Gaps that remain", body) for the targets not met or not judged in this run; None when every one was met."""
    offline = offline or {}
    rows = [r for r in target_rows(attn, lora, offline) if _missed(r)]
    if not rows:
        return None
    runs = offline.get("throughput") or []
    summary = {r["popularity"]: r for r in summarize_rounds(runs)}
    out = []
    for t in rows:
        name = t["target"]
        if name.startswith("multi-LoRA ÷ base throughput, "):
            pop = name.rsplit(", ", 1)[1]
            row = summary.get(pop)
            base = _same_round_base(runs, row) if row else None
            if row and base:
                judged = "" if t["meets"] is False else f" ({t['meets']}: the figures as measured)"
                out.append(over_base_gap(pop, row, base, offline) + judged)
        elif name.startswith("decode step ÷ HBM floor"):
            step = next((s for s in offline.get("decode_step") or [] if s["num_adapters"] == 0), None)
            if step:
                roof = step["roofline"]
                out.append(f"**Decode step ÷ HBM floor**: {1e3 * step['step_mean_s']:.2f} ms against a floor of "
                           f"{1e3 * roof['floor_s']:.2f} ms (weights {roof['weights'] / 1e9:.2f} GB and KV "
                           f"{roof['kv'] / 1e9:.2f} GB at {roof['copy_bandwidth_Bps'] / 1e12:.2f} TB/s): "
                           f"{1e3 * (step['step_mean_s'] - roof['floor_s']):.2f} ms above it: the step as a whole "
                           f"moved its bytes at {roof['floor_s'] / step['step_mean_s']:.0%} of the copy bandwidth "
                           "(this run does not split that time by kernel).")
        elif name.startswith("LoRA shrink/expand ÷ copy BW") and lora:
            _, graph = in_graph_kernels(lora)
            bandwidth = (lora.get("copy_bandwidth_gb_s") or 0) * 1e9
            if graph and bandwidth:
                worst = min(graph, key=lambda k: k["pct_copy_bw"])
                at_bw = 1e6 * worst["bytes"] / bandwidth
                fixed = [k["us"] - 1e6 * k["bytes"] / bandwidth for k in graph]
                out.append(f"**Worst LoRA kernel** ({worst['kernel']} {worst['proj']}): {worst['us']:.1f} µs for "
                           f"{worst['bytes'] / 1e6:.1f} MB, which take {at_bw:.1f} µs at the copy bandwidth. Over the "
                           f"{len(graph)} kernels of a layer, each took {min(fixed):.1f}–{max(fixed):.1f} µs more than its "
                           "bytes at the copy bandwidth: a fixed cost per launch that small kernels cannot hide.")
        elif name.startswith("all LoRA work of one decode step") and lora and lora.get("decode_step"):
            step = lora["decode_step"]
            launches = step.get("launches_planned") or step.get("kernels")
            over = step["time_ms"] - step["floor_ms"]
            text = (f"**64-adapter LoRA step**: {step['time_ms']:.2f} ms against a floor of {step['floor_ms']:.2f} ms "
                    f"and the target {LORA_STEP_TARGET_MS:g} ms")
            if launches:
                text += (f"; {over:.2f} ms above the floor over {launches} LoRA launches is {1e3 * over / launches:.1f} "
                         "µs each")
            text += "."
            floor = lora.get("launch_floor") or {}
            chain, empty = stand_in_ms(floor, "chain"), stand_in_ms(floor, "empty")
            if chain is not None and empty is not None:
                text += (f" The same {floor['num_launches']} launches with empty bodies take {empty:.2f} ms, and with "
                         f"only the dependent loads each program makes before its first multiply {chain:.2f} ms (same "
                         f"run, launch floor). Bandwidth floor + that chain: {step['floor_ms'] + chain:.2f} ms, an "
                         "estimate of what this launch structure allows (not a strict bound: with PDL part of each "
                         "chain overlaps the previous kernel's transfers); the other "
                         f"{step['time_ms'] - step['floor_ms'] - chain:.2f} ms are the kernels moving their bytes "
                         "below the copy bandwidth.")
            one = next((s for s in (lora.get("decode_steps") or {}).get("steps", [])
                        if s.get("policy") == "ticketed" and s.get("mix") == step.get("mix")), None)
            if one is not None:
                # one launch per projection (lora_ticketed), same run and workload: what halving the launches gave
                launches = one.get("launches_planned")
                text += (f" One launch per projection (the ticketed policy, same run and workload) took "
                         f"{one['time_ms']:.2f} ms" + (f" over {launches} launches" if launches else "") + ": "
                         + ("slower than" if one["time_ms"] > step["time_ms"] else "faster than or equal to")
                         + " the two launches.")
            out.append(text)
        elif name.startswith("speedup over HF + PEFT") or name.startswith("paged decode attention"):
            out.append(f"**{name}**: {t['measured']:.3g} against {t['goal']} ({t['note']}).")
    if not out:
        return None
    return ("Gaps that remain",
            "Computed from this run's figures, for each target above that was not met or not judged:\n\n"
            + "\n".join(f"- {p}" for p in out))


def main(argv: list[str] | None = None) -> int:
    """``python -m loraplex.bench.gaps REPORT.json``: the section for a report written before it existed."""
    import argparse
    import json
    from pathlib import Path

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report", help="an issue-9 report's JSON (bench all)")
    data = json.loads(Path(parser.parse_args(argv).report).read_text())
    section = gaps_section(data.get("attention"), data.get("lora_kernels"), data.get("offline"))
    print(f"## {section[0]}\n\n{section[1]}" if section else "every target was met")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
