"""A window bound that is valid ISO 8601 but leaves datetime's range once moved to UTC (year 1 at +01:00, year 9999
at -01:00) is a 400 naming the parameter (a CLI error naming the flag), not a 500 from an OverflowError."""

from __future__ import annotations

import pytest

from loraplex.cli import main
from loraplex.platform.errors import ApiError
from loraplex.platform.usage.aggregate import parse_time, window
from tests.integration.usage_app import usage_app

OUT_OF_RANGE = {"from": "0001-01-01T00:00:00+01:00", "to": "9999-12-31T23:59:59-01:00"}


@pytest.mark.parametrize("param", sorted(OUT_OF_RANGE))
def test_a_bound_outside_the_utc_range_is_refused_by_name(param):
    with pytest.raises(ApiError) as raised:
        parse_time(OUT_OF_RANGE[param], param)
    assert raised.value.status_code == 400 and raised.value.param == param
    assert "out of range" in raised.value.message


async def test_the_usage_routes_answer_400_not_500(tmp_path):
    async with usage_app(tmp_path) as ua:
        acme = await ua.tenant("acme")
        for param, value in OUT_OF_RANGE.items():
            query = {param: value}
            for path, key in (("/v1/usage", acme["key"]), ("/admin/usage/export", None)):
                r = await ua.client.get(path, params=query, headers=ua.headers(key))
                assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, query, r.text)


def test_the_cli_export_names_the_flag(tmp_path, capsys):
    data = str(tmp_path / "data")
    assert main(["admin", "tenant", "create", "acme", "--data-dir", data]) == 0
    capsys.readouterr()
    assert main(["usage", "export", "--data-dir", data, "--from", OUT_OF_RANGE["from"]]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --from ") and "out of range" in err and "Traceback" not in err, err


async def test_a_bound_too_long_is_refused_under_the_name_the_client_sent(tmp_path):
    """``from`` and ``to`` are the handler's ``start`` and ``end``: a value over the 40-character limit was a 400
    whose ``param`` named ``start`` or ``end``, which no client sends."""
    async with usage_app(tmp_path) as ua:
        acme = await ua.tenant("acme")
        for param in ("from", "to"):
            for path, key in (("/v1/usage", acme["key"]), ("/admin/usage/export", None)):
                r = await ua.client.get(path, params={param: "2026-01-01T00:00:00.000000000000000000000000Z"},
                                        headers=ua.headers(key))
                assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, r.text)


async def test_a_lone_bound_past_the_default_one_is_refused_naming_the_default():
    """``from`` in a later month with no ``to``: the window meets the default ``to`` (the start of next month); the
    400 named a ``to`` the client never sent ("to must be later than from.", param "to")."""
    with pytest.raises(ApiError) as raised:
        window("2999-02-01", None)
    assert raised.value.status_code == 400 and raised.value.param == "from"
    assert raised.value.message.startswith("to (not given: the start of next month, ")
    assert "from 2999-02-01T00:00:00Z" in raised.value.message and "pass both" in raised.value.message
    with pytest.raises(ApiError) as raised:
        window(None, "2000-01-01")
    assert raised.value.param == "to" and "from (not given: the start of this month" in raised.value.message
    with pytest.raises(ApiError) as raised:
        window("2026-03-01", "2026-02-01")
    assert raised.value.param == "to" and "pass both" not in raised.value.message
    assert raised.value.message == "to 2026-02-01T00:00:00Z must be later than from 2026-03-01T00:00:00Z."
