"""``loraplex bench online --smoke``: launches a real ``loraplex serve`` (CPU, tiny model), uploads adapters
through the API, sends Poisson-timed streaming requests and reports their latencies."""

from __future__ import annotations

import json

import pytest

from loraplex.bench.server_launch import launch_server
from loraplex.cli import main


def test_online_bench_launches_a_server_and_streams_every_request(tmp_path):
    rc = main(["bench", "online", "--smoke", "--popularity", "uniform", "--rate", "50",
               "--serve-env", "LORAPLEX_LOOP_TORCH_THREADS=1",
               "--work-dir", str(tmp_path / "work"), "--out-dir", str(tmp_path / "out")])
    (json_path,) = (tmp_path / "out").glob("online-*.json")
    data = json.loads(json_path.read_text())
    summary = data["summary"]
    assert rc == 0, summary["errors"]
    assert data["launched"] and len(data["adapters"]) == 2 and data["rate"] == 50.0
    assert summary["completed"] == 6 and summary["failed"] == 0
    assert summary["output_tokens"] == 6 * 4  # ignore_eos honoured through the API
    assert summary["ttft_s"]["count"] == 6  # every request's first token timed, visible text or not
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        assert summary[key]["count"] > 0 and summary[key]["p50"] > 0
    assert summary["e2e_s"]["p99"] >= summary["ttft_s"]["p99"]
    # the server's engine loop over the measured run, from its /metrics counters: it stepped for these requests
    loop = data["engine_loop"]
    assert loop["steps"] >= 6 and loop["step_ms"] > 0 and loop["dispatch_ms"] > 0 and 0 < loop["busy_share"] <= 1
    # a step's time: the loop thread on a CPU (on a GPU its device waits spin inside that) and off a CPU (the GIL,
    # the OS); the device wait is a part of the step either way
    assert loop["step_cpu_ms"] > 0 and 0 <= loop["device_wait_ms"] <= loop["step_ms"]
    assert loop["other_wait_ms"] == pytest.approx(max(0.0, loop["step_ms"] - loop["step_cpu_ms"]))
    # the regime: mean batch (>= 1 sequence per step) and the share of steps with prompt chunks (6 prompts ran)
    assert loop["seqs_per_step"] >= 1 and 0 < loop["prompt_step_share"] <= 1
    assert data["serve_env"] == ["LORAPLEX_LOOP_TORCH_THREADS=1"]
    md = next((tmp_path / "out").glob("online-*.md")).read_text()
    assert "TTFT" in md and "goodput" in md and data["command"] in md
    assert "sequences per step on average" in md
    assert "engine loop (in a process of its own) during the run" in md and "`LORAPLEX_LOOP_TORCH_THREADS=1`" in md


@pytest.mark.parametrize("name", ["LORAPLEX_DATABASE_URL", "LORAPLEX_PORT", "LORAPLEX_DATA_DIR"])
def test_launched_server_keeps_the_bench_owned_settings(tmp_path, name):
    with pytest.raises(ValueError, match=name):
        launch_server(tmp_path, [], env={name: "x"})


def test_serve_env_must_name_a_loraplex_setting(tmp_path):
    with pytest.raises(SystemExit, match="LORAPLEX_NAME=VALUE"):
        main(["bench", "online", "--smoke", "--serve-env", "PATH=/tmp", "--work-dir", str(tmp_path / "w"),
              "--out-dir", str(tmp_path / "o")])
