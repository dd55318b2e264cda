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
