"""``loraplex usage export -o PATH`` where PATH cannot be written: one ``error:`` line naming ``--output``,
exit 2, no traceback, and no file left behind."""

from __future__ import annotations

import pytest

from loraplex.cli import main


@pytest.fixture()
def data_dir(tmp_path, capsys) -> str:
    data = str(tmp_path / "data")
    assert main(["admin", "tenant", "create", "acme", "--data-dir", data]) == 0
    capsys.readouterr()
    return data


@pytest.mark.parametrize("where", ["missing-dir", "a-directory"])
def test_an_output_that_cannot_be_written_is_one_error_line_naming_output(where, data_dir, tmp_path, capsys):
    # both were a traceback: FileNotFoundError opening the partial file, IsADirectoryError renaming it
    target = {"missing-dir": tmp_path / "no-such-dir" / "usage.csv", "a-directory": tmp_path / "a-dir"}[where]
    if where == "a-directory":
        target.mkdir()
    rc = main(["usage", "export", "--data-dir", data_dir, "-o", str(target)])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "", err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith("error: --output") and str(target) in err, err
    left = {"missing-dir": {"data"}, "a-directory": {"data", "a-dir"}}[where]
    assert {p.name for p in tmp_path.iterdir()} == left  # no partial file left behind
    if where == "a-directory":
        assert list(target.iterdir()) == []


@pytest.mark.parametrize("flags, needles", [
    (["--from", "2999-02-01"], ["--to (not given: the start of next month", "--from 2999-02-01T00:00:00Z",
                                "pass both"]),
    (["--to", "2000-01-01"], ["--to 2000-01-01T00:00:00Z", "--from (not given: the start of this month"]),
    (["--from", "2026-02-01", "--to", "2026-01-01"], ["--to 2026-01-01T00:00:00Z", "--from 2026-02-01T00:00:00Z"]),
])
def test_an_empty_window_names_both_flags_and_the_default_that_was_taken(flags, needles, data_dir, capsys):
    """A lone --from in a later month used to be refused as "--to must be later than from." although no --to
    was typed: the message names each bound, and says which one is a default."""
    rc = main(["usage", "export", "--data-dir", data_dir, *flags])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert err.startswith("error: ") and all(n in err for n in needles), err


def test_an_export_whose_reader_goes_away_gives_its_connection_back_before_it_ends(data_dir):
    """``loraplex usage export | head -1`` on a ledger with rows: the write that fails comes while the ledger query
    streams. The query's connection was left checked out past the engine's dispose and cleaned up by the garbage
    collector at exit, which wrote "Task was destroyed but it is pending!" and pool tracebacks under the one-line
    message (about every other run)."""
    import asyncio
    import os
    from datetime import datetime, timedelta, timezone

    from sqlalchemy import event as sa_event
    from sqlalchemy.pool import Pool

    from loraplex.cli import build_parser
    from loraplex.platform.db import make_engine, make_session_factory
    from loraplex.platform.tenants import get_tenant
    from loraplex.platform.usage.cli import _export_async
    from loraplex.platform.usage.ledger import event_record, insert_records
    from tests.unit.usage.ledger_env import event

    async def fill() -> None:
        db = make_engine(f"sqlite+aiosqlite:///{data_dir}/loraplex.db")
        sessions = make_session_factory(db)
        async with sessions() as s:
            tid = (await get_tenant(s, "acme")).id
        start = datetime(2020, 1, 1, tzinfo=timezone.utc)
        await insert_records(sessions, [event_record(event(f"r{i}", tid, at=start + timedelta(days=i)))
                                        for i in range(50)])
        await db.dispose()

    asyncio.run(fill())

    class HeadOne:
        """A pipe to a reader that takes the first line (the CSV header) and exits, as ``| head -1`` does."""

        def __init__(self):
            self.read_end, self.write_end = os.pipe()

        def write(self, chunk: bytes) -> None:
            os.write(self.write_end, chunk)
            if self.read_end is not None:
                os.close(self.read_end)
                self.read_end = None

    checked_out = []
    on_checkout, on_checkin = (lambda *a: checked_out.append(1)), (lambda *a: checked_out.pop())
    sa_event.listen(Pool, "checkout", on_checkout)
    sa_event.listen(Pool, "checkin", on_checkin)
    out = HeadOne()
    try:
        args = build_parser().parse_args(["usage", "export", "--data-dir", data_dir, "--from", "2020-01-01",
                                          "--to", "2021-01-01"])
        with pytest.raises(BrokenPipeError):
            asyncio.run(_export_async(args, out))
        assert checked_out == [], "the ledger query's connection was still checked out when the export ended"
    finally:
        sa_event.remove(Pool, "checkout", on_checkout)
        sa_event.remove(Pool, "checkin", on_checkin)
        os.close(out.write_end)
