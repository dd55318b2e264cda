"""Geometry of the usage page's SVG bar charts (drawn by the template: no chart library, no script)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import date, timedelta

DAY_W, DAY_H = 760, 230  # viewBox of the by-day chart
PAD_L, PAD_R, PAD_T, PAD_B = 56, 10, 12, 28
ROW_H, LABEL_W, ADAPTER_W = 30, 190, 760


def nice_max(value: float, ticks: int = 4) -> float:
    """A round axis maximum >= value whose ``ticks`` equal steps are round too (1, 2 or 5 x 10^k each)."""
    if value <= 0:
        return float(ticks)
    raw = value / ticks
    exp = 10 ** math.floor(math.log10(raw))
    for step in (1, 2, 5, 10):
        if step * exp >= raw:
            return max(step * exp, 1) * ticks
    return 10 * exp * ticks


def short(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            text = f"{n / size:.1f}".rstrip("0").rstrip(".")
            return text + unit
    return f"{n:.0f}"


@dataclass
class DayBar:
    label: str  # YYYY-MM-DD
    prompt: int
    completion: int
    x: float
    w: float
    y_prompt: float
    h_prompt: float
    y_completion: float
    h_completion: float
    show_label: bool

    @property
    def total(self) -> int:
        return self.prompt + self.completion


@dataclass
class DayChart:
    bars: list[DayBar]
    ticks: list[tuple[float, str]]  # (y, label)
    width: int = DAY_W
    height: int = DAY_H
    left: int = PAD_L
    right: int = DAY_W - PAD_R
    bottom: int = DAY_H - PAD_B
    empty: bool = False


def day_chart(start: date, end: date, tokens: dict[str, tuple[int, int]]) -> DayChart:
    """Bars for each day in [start, end): prompt tokens stacked under completion tokens."""
    days = [start + timedelta(days=i) for i in range((end - start).days)] or [start]
    plot_w, plot_h = DAY_W - PAD_L - PAD_R, DAY_H - PAD_T - PAD_B
    top = nice_max(max((sum(tokens.get(d.isoformat(), (0, 0))) for d in days), default=0))
    slot = plot_w / len(days)
    every = max(1, math.ceil(len(days) / 10))  # at most ~10 date labels
    bars = []
    for i, d in enumerate(days):
        prompt, completion = tokens.get(d.isoformat(), (0, 0))
        h_p = plot_h * prompt / top
        h_c = plot_h * completion / top
        base = PAD_T + plot_h
        bars.append(DayBar(
            label=d.isoformat(), prompt=prompt, completion=completion, x=PAD_L + i * slot + slot * 0.15,
            w=max(1.0, slot * 0.7), y_prompt=base - h_p, h_prompt=h_p, y_completion=base - h_p - h_c,
            h_completion=h_c, show_label=(i % every == 0),
        ))
    ticks = [(PAD_T + plot_h * (1 - k / 4), short(top * k / 4)) for k in range(5)]
    return DayChart(bars, ticks, empty=not any(tokens.values()))


@dataclass
class AdapterBar:
    label: str
    tokens: int
    requests: int
    y: float
    w: float


@dataclass
class AdapterChart:
    bars: list[AdapterBar] = field(default_factory=list)
    width: int = ADAPTER_W
    height: int = ROW_H
    label_w: int = LABEL_W


def adapter_chart(totals: dict[str, tuple[int, int]], limit: int = 12) -> AdapterChart:
    """Horizontal bars of total tokens per model/adapter label, largest first; ``totals`` label ->
    (tokens, requests)."""
    items = sorted(totals.items(), key=lambda kv: (-kv[1][0], kv[0]))[:limit]
    if not items:
        return AdapterChart()
    top = max(t for _, (t, _) in items) or 1
    span = ADAPTER_W - LABEL_W - 70  # room for the value on the right
    bars = [AdapterBar(label, tokens, requests, y=i * ROW_H + 5, w=max(1.0, span * tokens / top))
            for i, (label, (tokens, requests)) in enumerate(items)]
    return AdapterChart(bars, height=len(bars) * ROW_H + 6)
