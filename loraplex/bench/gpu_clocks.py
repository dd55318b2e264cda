"""The GPU's SM clock, power draw and temperature while a timed run lasts (``nvidia-smi`` in loop mode).

A run whose steps slow down for no reason of their own (the base model's decode steps moved 12.0-13.5 ms between
rounds of one H200 report, run 21) may have run at lower clocks: a power or thermal limit, or another tenant of the
card. ``GpuClockSampler`` records what the driver reported every ``interval_ms`` during the run, so a report can
tell a slower GPU from slower code. Where ``nvidia-smi`` or CUDA is missing it records nothing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading

FIELDS = ("clocks.sm", "power.draw", "temperature.gpu")


def parse_sample(line: str) -> tuple[float, float, float] | None:
    """One ``--format=csv,noheader,nounits`` line of FIELDS -> (SM MHz, W, °C); None for anything else ("[N/A]")."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != len(FIELDS):
        return None
    try:
        return tuple(float(p) for p in parts)  # type: ignore[return-value]
    except ValueError:
        return None


def summarize(samples: list[tuple[float, float, float]]) -> dict | None:
    if not samples:
        return None
    clocks, power, temp = zip(*samples)
    return {"gpu_samples": len(samples), "sm_clock_mhz_mean": sum(clocks) / len(clocks),
            "sm_clock_mhz_min": min(clocks), "power_w_mean": sum(power) / len(power), "gpu_temp_c_max": max(temp)}


def _gpu_id(device) -> str | None:
    """The card's UUID as nvidia-smi names it (its indices ignore CUDA_VISIBLE_DEVICES), or None off CUDA."""
    import torch

    if not torch.cuda.is_available() or torch.device(device).type != "cuda":
        return None
    device = torch.device(device)
    uuid = str(getattr(torch.cuda.get_device_properties(device), "uuid", "") or "")
    if uuid:
        return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
    # no UUID from this torch: nvidia-smi's index is CUDA's only when no CUDA_VISIBLE_DEVICES remaps it
    if os.environ.get("CUDA_VISIBLE_DEVICES") is None:
        return str(device.index if device.index is not None else torch.cuda.current_device())
    return None


class GpuClockSampler:
    """``with GpuClockSampler(device): run()``, then ``.summary()`` (None when nothing was sampled)."""

    def __init__(self, device, interval_ms: int = 200, executable: str | None = None, gpu: str | None = None) -> None:
        """``executable`` / ``gpu``: another nvidia-smi, or the card's id, instead of those found for ``device``."""
        self.interval_ms = interval_ms
        self.executable = executable or shutil.which("nvidia-smi")
        self.gpu = gpu or (_gpu_id(device) if self.executable else None)
        self.samples: list[tuple[float, float, float]] = []
        self._proc: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None

    def __enter__(self) -> GpuClockSampler:
        if self.executable and self.gpu:
            try:
                self._proc = subprocess.Popen(
                    [self.executable, "-i", self.gpu, f"--query-gpu={','.join(FIELDS)}",
                     "--format=csv,noheader,nounits", "-lms", str(self.interval_ms)],
                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            except OSError:
                self._proc = None
            else:
                self._reader = threading.Thread(target=self._read, name="gpu-clock-sampler", daemon=True)
                self._reader.start()
        return self

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            sample = parse_sample(line)
            if sample is not None:
                self.samples.append(sample)

    def __exit__(self, *exc) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            if self._reader is not None:
                self._reader.join(timeout=5)

    def summary(self) -> dict | None:
        return summarize(self.samples)
