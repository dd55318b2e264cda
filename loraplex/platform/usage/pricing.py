"""Money with :class:`~decimal.Decimal` only: prices per million tokens and costs of token counts.

Costs are computed from *summed* token counts at aggregation time, so no per-request rounding ever
accumulates; with prices of at most :data:`MAX_PRICE_DECIMALS` places every cost is exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone
from decimal import Decimal, InvalidOperation, localcontext

from loraplex.platform.errors import bad_request

MILLION = Decimal(1_000_000)
MAX_PRICE = Decimal(1_000_000)  # per million tokens
MAX_PRICE_DECIMALS = 9
ANY_ADAPTER = "*"
ZERO = Decimal(0)
EXACT_PRECISION = 80


def parse_price(value: str | int | float, param: str) -> Decimal:
    """A price from a request (string or number): finite, 0..MAX_PRICE, at most 9 decimal places.
    Numbers are read through their shortest decimal text, so ``0.1`` means exactly 0.1."""
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise bad_request(f"{param} must be a decimal string such as \"0.15\".", param=param)
    text = str(value).strip()
    try:
        if "_" in text:  # Decimal reads "1_0" as 10, as Python source would: not a price anyone writes
            raise InvalidOperation
        price = Decimal(text)
    except InvalidOperation:
        raise bad_request(f"{param} must be a decimal number, got {value!r}.", param=param) from None
    if not price.is_finite() or price < 0 or price > MAX_PRICE:
        raise bad_request(f"{param} must be between 0 and {MAX_PRICE} per million tokens, got {value!r}.",
                          param=param)
    if -price.normalize().as_tuple().exponent > MAX_PRICE_DECIMALS:  # trailing zeros are not places: "0.10000000000"
        raise bad_request(f"{param} has more than {MAX_PRICE_DECIMALS} decimal places.", param=param)
    return price


def price_text(price: Decimal) -> str:
    """Canonical storage text (no exponent, no trailing zeros)."""
    text = format(price.normalize(), "f")
    return text if text != "-0" else "0"


@dataclass(frozen=True)
class Prices:
    currency: str = "USD"
    input_per_mtok: Decimal = ZERO
    cached_input_per_mtok: Decimal = ZERO
    output_per_mtok: Decimal = ZERO
    adapter_surcharges: dict[str, Decimal] = field(default_factory=dict)

    @classmethod
    def from_plan(cls, plan) -> Prices:
        if plan is None:
            return cls()
        return cls(
            currency=plan.currency, input_per_mtok=Decimal(plan.input_per_mtok),
            cached_input_per_mtok=Decimal(plan.cached_input_per_mtok), output_per_mtok=Decimal(plan.output_per_mtok),
            adapter_surcharges={k: Decimal(v) for k, v in (plan.adapter_surcharges or {}).items()},
        )

    def surcharge(self, adapter_id: str | None) -> Decimal:
        if adapter_id is None:
            return ZERO
        return self.adapter_surcharges.get(adapter_id, self.adapter_surcharges.get(ANY_ADAPTER, ZERO))

    def cost(self, prompt_tokens: int, cached_prompt_tokens: int, completion_tokens: int,
             adapter_id: str | None = None) -> Decimal:
        """Exact cost of these (summed) counts; cached prompt tokens are billed at the cached price."""
        uncached = prompt_tokens - cached_prompt_tokens
        assert uncached >= 0, "cached prompt tokens are a part of the prompt tokens"
        with localcontext(prec=EXACT_PRECISION):  # the default 28 digits could round large totals
            per_million = (
                uncached * self.input_per_mtok + cached_prompt_tokens * self.cached_input_per_mtok
                + completion_tokens * self.output_per_mtok
                + (prompt_tokens + completion_tokens) * self.surcharge(adapter_id)
            )
            return per_million / MILLION


def money_text(amount: Decimal) -> str:
    """Exact, fixed-point, at least 2 decimals (``12.5`` -> ``12.50``)."""
    text = format(amount, "f")
    whole, _, frac = text.partition(".")
    frac = frac.rstrip("0")
    return f"{whole}.{frac.ljust(2, '0')}"


def month_bounds(when: datetime) -> tuple[datetime, datetime]:
    """[first instant of ``when``'s UTC month, first instant of the next month)."""
    when = when.astimezone(timezone.utc)
    start = datetime(when.year, when.month, 1, tzinfo=timezone.utc)
    end = datetime(when.year + (when.month == 12), when.month % 12 + 1, 1, tzinfo=timezone.utc)
    return start, end
