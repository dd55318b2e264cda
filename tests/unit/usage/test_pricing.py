"""Money is Decimal end to end: exact costs, strict price parsing, UTC month bounds."""

from __future__ import annotations

from datetime import datetime, timezone
from decimal import Decimal

import pytest

from loraplex.platform.errors import ApiError
from loraplex.platform.usage.pricing import Prices, money_text, month_bounds, parse_price, price_text


def test_cost_is_exact_where_floats_drift():
    prices = Prices(input_per_mtok=Decimal("0.1"), cached_input_per_mtok=Decimal("0.05"),
                    output_per_mtok=Decimal("0.3"), adapter_surcharges={"*": Decimal("0.02"), "a1": Decimal("0.2")})
    # 3 x 0.1 in float is 0.30000000000000004; in Decimal it is 0.3
    assert prices.cost(3_000_000, 0, 0) == Decimal("0.3")
    # uncached input, cached input, output, and the adapter's own surcharge on prompt + completion
    cost = prices.cost(1_000_000, 400_000, 2_000_000, "a1")
    assert cost == Decimal("0.6") * Decimal("0.1") + Decimal("0.4") * Decimal("0.05") + 2 * Decimal("0.3") + 3 * Decimal("0.2")
    assert prices.cost(1_000_000, 0, 0, "other") == Decimal("0.12")  # the "*" surcharge
    assert prices.cost(1_000_000, 0, 0, None) == Decimal("0.1")  # base model: no surcharge


def test_summing_costs_of_parts_equals_cost_of_the_sum():
    prices = Prices(input_per_mtok=Decimal("0.123456789"), output_per_mtok=Decimal("7.000000001"))
    parts = [(17, 0, 5), (1, 0, 999), (123_456, 0, 7)]
    total = sum((prices.cost(p, c, o) for p, c, o in parts), Decimal(0))
    assert total == prices.cost(sum(p for p, _, _ in parts), 0, sum(o for _, _, o in parts))


def test_huge_totals_do_not_round():
    prices = Prices(input_per_mtok=Decimal("999999.123456789"))
    assert prices.cost(10**15, 0, 0) == Decimal("999999.123456789") * 10**9


@pytest.mark.parametrize("value", ["0.15", 2, 0.1, "1e-3", "0", "1000000", "0.10000000000", "1000000.000000000000"])
def test_valid_prices(value):
    assert parse_price(value, "input_per_mtok") == Decimal(str(value))  # trailing zeros are no decimal places


@pytest.mark.parametrize("value", ["-1", "abc", "NaN", "Infinity", "1000001", "0.0000000001", "1_0", "0.1_5", True,
                                   None, [1]])
def test_invalid_prices_name_the_field(value):
    with pytest.raises(ApiError) as err:
        parse_price(value, "output_per_mtok")
    assert err.value.status_code == 400 and err.value.param == "output_per_mtok"


def test_text_forms():
    assert price_text(Decimal("1.500")) == "1.5" and price_text(Decimal("1E+2")) == "100"
    assert money_text(Decimal("12.5")) == "12.50" and money_text(Decimal("0.000057")) == "0.000057"
    assert money_text(Decimal(0)) == "0.00"


def test_month_bounds_cross_the_year():
    assert month_bounds(datetime(2026, 12, 31, 23, 59, 59, 999999, tzinfo=timezone.utc)) == (
        datetime(2026, 12, 1, tzinfo=timezone.utc), datetime(2027, 1, 1, tzinfo=timezone.utc))
    start, end = month_bounds(datetime(2027, 2, 1, tzinfo=timezone.utc))
    assert (start.month, end.month) == (2, 3)
