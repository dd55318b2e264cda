"""The report's "Gaps that remain": what each missed target's gap is made of, from the run's own figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loraplex.bench.gaps import gaps_section
from loraplex.bench.offline import add_over_base
from loraplex.bench.roofline import ModelShape

SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
         "head_dim": 16, "vocab_size": 100, "tie_word_embeddings": False}


def _run(pop, wall, decode_s, prefill_s, adapters=0.0, roof_ratio=None):
    return {"popularity": pop, "elapsed_s": wall, "output_tok_per_s": 1000 / wall, "output_tokens": 1000,
            "prompt_tokens": 2000, "round": 1, "num_adapters": 0, "num_requests": 10, "total_tok_per_s": 3000 / wall,
            "roofline_over_base": roof_ratio, "wall_over_floor": 1.5,
            "roofline": {"mean_decode_adapters": adapters},
            "diagnostics": {"decode_steps": 100, "decode_s": decode_s, "prefill_steps": 4, "prefill_s": prefill_s}}


def _offline(runs):
    add_over_base(runs)
    return {"throughput": runs, "copy_bandwidth_Bps": 1e9, "model_shape": SHAPE,
            "settings": {"rank": 8, "dtype": "bfloat16"}}


def test_a_missed_ratio_is_split_into_decode_and_prompt_steps_with_the_bytes_behind_them():
    offline = _offline([_run("base", 10.0, 6.0, 4.0), _run("zipf", 12.0, 7.5, 4.5, adapters=5.0, roof_ratio=0.95)])
    title, body = gaps_section(None, None, offline)
    assert title == "Gaps that remain"
    line = next(p for p in body.splitlines() if p.startswith("- **zipf**"))
    # 0.833 against 0.93: the run must take 12 - 10 / 0.93 = 1.25 s less
    assert "(0.833 against 0.93, round 1): 12.00 s against the base run's 10.00 s" in line
    assert "needs 1.25 s less" in line
    # decode: 75 - 60 = +15 ms a step over 100 steps; 5 adapters of rank 8 in bf16 at 1 GB/s
    per_adapter = ModelShape(**SHAPE).lora_params_per_rank() * 8 * 2
    floor_ms = 1e3 * 5 * per_adapter / 1e9
    assert "Decode steps: +15.00 ms each (75.00 against 60.00), +1.50 s over 100 steps" in line
    assert f"{floor_ms:.2f} ms at the copy bandwidth" in line and f"ran at {floor_ms / 15:.0%} of it" in line
    # prompt steps: +125 ms each; 500 prompt tokens a step, every projection output written and read once more
    outputs = 2 * (64 + 2 * 32 + 64 + 2 * 128 + 64)
    assert "Steps with prompt tokens: +125.0 ms each, +0.50 s over 4 steps" in line
    assert f"{1e3 * 500 * outputs * 2 * 2 / 1e9:.1f} ms at the copy bandwidth" in line
    assert "The roofline allows 0.950; the run's ratio is 88% of that." in line


def test_a_target_above_the_roofline_says_so_and_met_targets_have_no_gap():
    offline = _offline([_run("base", 10.0, 6.0, 4.0), _run("distinct", 14.0, 9.0, 5.0, 50.0, roof_ratio=0.75),
                        _run("uniform", 10.5, 6.4, 4.1, 3.0, roof_ratio=0.96)])
    body = gaps_section(None, None, offline)[1]
    assert "The roofline allows 0.750 for this workload: the target is above it" in body
    assert "**uniform**" not in body  # 0.952 >= 0.90: met


def test_nothing_missed_gives_no_section():
    assert gaps_section(None, None, _offline([_run("base", 10.0, 6.0, 4.0), _run("zipf", 10.2, 6.1, 4.1)])) is None


RUN14 = Path(__file__).resolve().parents[3] / "docs/benchmarks/issue9-20261202-192910.json"  # run 14's full report


@pytest.mark.skipif(not RUN14.exists(), reason="run 14's report is not in this checkout")
def test_a_saved_full_report_gets_one_line_per_missed_target():
    d = json.loads(RUN14.read_text())
    body = gaps_section(d["attention"], d["lora_kernels"], d["offline"])[1]
    lines = [p for p in body.splitlines() if p.startswith("- ")]
    assert [p.split("**")[1] for p in lines] == ["zipf", "distinct", "Worst LoRA kernel", "64-adapter LoRA step"]
    assert "Decode steps: +2.35 ms each (13.54 against 11.18)" in lines[0]
    assert "the target is above it" in lines[1]
    assert "7.3 µs for 9.4 MB" in lines[2] and "over 256 LoRA launches is 4.0 µs each" in lines[3]


@pytest.mark.skipif(not RUN14.exists(), reason="run 14's report is not in this checkout")
def test_the_command_prints_the_section_of_a_saved_report(capsys):
    from loraplex.bench.gaps import main

    assert main([str(RUN14)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("## Gaps that remain\n\n") and "- **zipf** (0.888 against 0.93" in out


@pytest.mark.skipif(not RUN14.exists(), reason="run 14's report is not in this checkout")
def test_the_lora_step_gap_is_split_by_the_launch_floor_of_the_same_run():
    d = json.loads(RUN14.read_text())
    lora = d["lora_kernels"]
    step = lora["decode_step"]
    lora["launch_floor"] = {"num_launches": 256, "rows": [
        {"body": "real", "pdl": "as recorded", "time_ms": 2.8},
        {"body": "empty", "pdl": "as recorded", "time_ms": 0.40}, {"body": "empty", "pdl": "off", "time_ms": 0.32},
        {"body": "chain", "pdl": "as recorded", "time_ms": 0.46}, {"body": "chain", "pdl": "off", "time_ms": 0.65}]}
    line = next(p for p in gaps_section(d["attention"], lora, d["offline"])[1].splitlines()
                if p.startswith("- **64-adapter LoRA step**"))
    # the fastest of each stand-in; the chain added to the bandwidth floor, the rest is the kernels' own
    assert "empty bodies take 0.32 ms" in line and "before its first multiply 0.46 ms" in line
    assert f"Bandwidth floor + that chain: {step['floor_ms'] + 0.46:.2f} ms" in line
    assert f"the other {step['time_ms'] - step['floor_ms'] - 0.46:.2f} ms are the kernels" in line
    del lora["launch_floor"]  # a report without it keeps the old line
    line = next(p for p in gaps_section(d["attention"], lora, d["offline"])[1].splitlines()
                if p.startswith("- **64-adapter LoRA step**"))
    assert "launch floor" not in line and line.endswith("µs each.")


RUN27 = Path(__file__).resolve().parents[3] / "docs/benchmarks/issue9-20261206-204408.json"  # run 27's full report


@pytest.mark.skipif(not RUN27.exists(), reason="run 27's report is not in this checkout")
def test_the_lora_step_gap_names_the_one_launch_policy_of_the_same_run():
    """Run 27 (H200) measured the ticketed policy beside the default: the gap line says what halving the launches
    gave, from the same run and workload; a report without that policy keeps the line as it was."""
    d = json.loads(RUN27.read_text())
    lora = d["lora_kernels"]
    one = next(s for s in lora["decode_steps"]["steps"]
               if s["policy"] == "ticketed" and s["mix"] == lora["decode_step"]["mix"])

    def line():
        return next(p for p in gaps_section(d["attention"], lora, d["offline"])[1].splitlines()
                    if p.startswith("- **64-adapter LoRA step**"))

    assert (f"One launch per projection (the ticketed policy, same run and workload) took {one['time_ms']:.2f} ms "
            f"over 128 launches: slower than the two launches.") in line()
    lora["decode_steps"]["steps"] = [s for s in lora["decode_steps"]["steps"] if not s["policy"].startswith("ticketed")]
    assert "ticketed" not in line() and line().endswith("below the copy bandwidth.")
