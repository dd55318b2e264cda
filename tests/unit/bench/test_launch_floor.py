"""The launch-floor benchmark on the CPU (interpreter, tiny shapes; timings meaningless): it records the real decode
step's launches without running them, its chain stand-in stores what its twin says, and the report is written."""

from __future__ import annotations

import json
import os

import pytest
import torch

os.environ["TRITON_INTERPRET"] = "1"

from loraplex.bench import launch_floor  # noqa: E402
from loraplex.bench.lora_kernels import SMOKE, _DecodeStepBench  # noqa: E402
from loraplex.kernels.stand_in import chain_kernel  # noqa: E402


def _bench(tokens=8):
    from loraplex.adapters.modules import BaseShapes

    return _DecodeStepBench(BaseShapes.from_config(SMOKE), tokens, 16, torch.device("cpu"), torch.float32)


def test_records_two_launches_per_projection_and_layer_and_runs_none():
    from loraplex.adapters.mapping import LoRAStep

    bench = _bench()
    bench.slots.copy_(torch.arange(8, dtype=torch.int32))
    before = {p: o.clone() for p, o in bench.outs.items()}
    launches = launch_floor.record_launches(bench, bench.make_step(LoRAStep))
    layers = bench.shapes.num_layers
    assert len(launches) == layers * 4 * 2
    assert [e["kind"] for e in launches[:2]] == ["shrink", "expand"]
    assert all(len(e["grid"]) == 3 and min(e["grid"]) >= 1 and not e["pdl"] for e in launches)  # no PDL on the CPU
    assert all(torch.equal(before[p], bench.outs[p]) for p in bench.outs)  # recorded, not run
    # the kernels are back: a real step changes the outputs again
    bench.run(bench.make_step(LoRAStep))
    assert any(not torch.equal(before[p], bench.outs[p]) for p in bench.outs)


@pytest.mark.parametrize("programs,count", [(6, 6), (6, 4)])
def test_chain_stand_in_stores_its_twin_for_the_programs_below_the_count(programs, count):
    launches = [{"kind": "shrink", "grid": (3, 1, 2), "num_warps": 4, "pdl": False}] * 2
    stand = launch_floor._Stand(launches, torch.device("cpu"), torch.float32)
    stand.count.fill_(count)
    stand.out.fill_(-7.0)
    entry = launches[1]
    chain_kernel[entry["grid"]](stand.count, stand.table, stand.w, stand.x, stand.out, stand.widest,
                                              BLOCK_M=launch_floor.CHAIN_M, BLOCK_K=launch_floor.CHAIN_K,
                                              USE_PDL=False)
    want = launch_floor.chain_reference(stand.table, stand.w, stand.x, stand.widest, count)
    torch.testing.assert_close(stand.out[:count], want, rtol=1e-5, atol=1e-5)
    assert torch.all(stand.out[count:programs] == -7.0)  # programs at or past the count return before any store


def test_smoke_run_writes_the_report(tmp_path):
    out = tmp_path / "floor.json"
    assert launch_floor.main(["--smoke", "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert payload["num_launches"] == SMOKE["num_hidden_layers"] * 8
    bodies = [(r["body"], r["pdl"]) for r in payload["rows"]]
    assert bodies == [("real", "as recorded"), ("real", "as recorded"), ("empty", "off"), ("chain", "off")]
    assert all(r["time_ms"] > 0 for r in payload["rows"])
    md = out.with_suffix(".md").read_text()
    assert "| stand-in: chain | off |" in md and "python -m loraplex.bench.launch_floor --smoke" in md
    assert launch_floor.chain_floor_ms(payload) == payload["rows"][3]["time_ms"]
    # the same table is a section of the LoRA kernel report (and so of `bench all`)
    from loraplex.bench import lora_kernels

    lk = lora_kernels._markdown({"environment": {"device_name": "cpu"}, "command": "c", "copy_bandwidth_gb_s": 1.0,
                                 "kernels": [], "launch_floor": payload})
    assert "### The launch floor of that step" in lk and "| stand-in: empty | off |" in lk


@pytest.mark.parametrize("argv, flag", [(["--tokens", "0"], "--tokens"), (["--grid-caps", "132,x"], "--grid-caps"),
                                        (["--grid-caps", "2"], "--grid-caps")])
def test_bad_sizes_are_named(tmp_path, capsys, argv, flag):
    with pytest.raises(SystemExit) as exc:
        launch_floor.main(["--smoke", *argv, "--out", str(tmp_path / "f.json")])
    assert exc.value.code == 2 and flag in capsys.readouterr().err


def test_grid_caps_cut_the_first_dimension_only_and_leave_the_floor_figures_alone(tmp_path):
    assert launch_floor.capped((544, 1, 3), 132) == (44, 1, 3)
    assert launch_floor.capped((272, 2, 1), 132) == (66, 2, 1)
    assert launch_floor.capped((16, 1, 3), 132) == (16, 1, 3)  # already below the cap
    assert launch_floor.capped((16, 1, 3), 2) == (1, 1, 3)  # one program per slice at least
    assert launch_floor.capped((16, 1, 3), None) == (16, 1, 3)
    out = tmp_path / "floor.json"
    assert launch_floor.main(["--smoke", "--grid-caps", "3", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    capped = [r for r in rows if r.get("grid_cap") == 3]
    assert [r["body"] for r in capped] == ["empty", "chain"] and "at most 3 programs" in capped[1]["launches"]
    plain_chain = next(r for r in rows if r["body"] == "chain" and not r.get("grid_cap"))
    assert launch_floor.chain_floor_ms({"rows": rows}) == plain_chain["time_ms"]
