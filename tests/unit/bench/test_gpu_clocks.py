"""The GPU clock sampler of the offline runs: parsing nvidia-smi's lines, the summary, the process's life."""

from __future__ import annotations

import sys
import time

import pytest

from loraplex.bench.gpu_clocks import GpuClockSampler, parse_sample, summarize


def test_lines_parse_and_unavailable_fields_are_skipped():
    assert parse_sample("1980, 512.34, 61\n") == (1980.0, 512.34, 61.0)
    assert parse_sample("1980, [N/A], 61") is None and parse_sample("") is None and parse_sample("1, 2") is None
    s = summarize([(1980.0, 500.0, 60.0), (1500.0, 700.0, 66.0)])
    assert s == {"gpu_samples": 2, "sm_clock_mhz_mean": 1740.0, "sm_clock_mhz_min": 1500.0, "power_w_mean": 600.0,
                 "gpu_temp_c_max": 66.0}
    assert summarize([]) is None


def test_without_nvidia_smi_or_cuda_nothing_is_sampled():
    with GpuClockSampler("cpu", executable="/nonexistent/nvidia-smi") as sampler:
        pass
    assert sampler.summary() is None


def test_the_sampler_reads_its_process_until_the_run_ends(tmp_path):
    """A stand-in for nvidia-smi (this machine has no GPU): it checks the arguments the sampler passes, then prints a
    line every 10 ms like `nvidia-smi -lms 10`, until the sampler stops it."""
    exe = tmp_path / "smi"
    exe.write_text(f"#!{sys.executable}\n" + '''
import sys, time
args = sys.argv[1:]
assert args[:2] == ["-i", "GPU-test"], args
assert "--query-gpu=clocks.sm,power.draw,temperature.gpu" in args and args[-2:] == ["-lms", "10"], args
print("header, not a sample", flush=True)
while True:
    print("1755, 650.5, 58", flush=True)
    time.sleep(0.01)
''')
    exe.chmod(0o755)
    with GpuClockSampler("cpu", interval_ms=10, executable=str(exe), gpu="GPU-test") as sampler:
        deadline = time.monotonic() + 10
        while len(sampler.samples) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
    summary = sampler.summary()
    assert summary is not None and summary["gpu_samples"] >= 3
    assert summary["sm_clock_mhz_mean"] == pytest.approx(1755) and summary["power_w_mean"] == pytest.approx(650.5)
    assert sampler._proc.poll() is not None  # stopped with the run
