"""Chart geometry: round axes, every day of the window, bars proportional to tokens."""

from __future__ import annotations

from datetime import date

from loraplex.platform.console.charts import adapter_chart, day_chart, nice_max


def test_axis_maximum_is_round_and_covers_the_data():
    for value, top in ((0, 4), (3, 4), (34, 40), (99, 200), (1234, 2000), (7, 8)):
        assert nice_max(value) == top
        assert nice_max(value) >= value


def test_day_chart_has_a_bar_per_day_stacked_and_scaled():
    chart = day_chart(date(2026, 11, 1), date(2026, 11, 8), {"2026-11-03": (10, 30), "2026-11-05": (5, 0)})
    assert [b.label for b in chart.bars][0] == "2026-11-01" and len(chart.bars) == 7
    tall, small = chart.bars[2], chart.bars[4]
    assert tall.total == 40 and small.total == 5
    # the tallest bar reaches the top of the axis (max 40), the completion part sits on the prompt part
    assert abs((tall.h_prompt + tall.h_completion) - (chart.bottom - 12)) < 1e-6
    assert abs(tall.y_completion + tall.h_completion - tall.y_prompt) < 1e-6
    assert abs(small.h_prompt / tall.h_prompt - 0.5) < 1e-6
    assert chart.bars[0].h_prompt == chart.bars[0].h_completion == 0
    assert not chart.empty and day_chart(date(2026, 11, 1), date(2026, 11, 2), {}).empty


def test_adapter_chart_orders_largest_first():
    chart = adapter_chart({"base model": (10, 2), "acme/a": (40, 1), "acme/b": (20, 3)})
    assert [b.label for b in chart.bars] == ["acme/a", "acme/b", "base model"]
    assert chart.bars[0].w > chart.bars[1].w > chart.bars[2].w
    assert abs(chart.bars[1].w / chart.bars[0].w - 0.5) < 1e-6
