"""A window bound that is valid ISO 8601 but leaves datetime's range once moved to UTC (year 1 at +01:00, year 9999
at -01:00) is a 400 naming the parameter (a CLI error naming the flag), not a 500 from an OverflowError."""

from __future__ import annotations

import pytest

from loraplex.cli import main
from loraplex.platform.errors import ApiError
from loraplex.platform.usage.aggregate import parse_time
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
