"""Operator mistakes on the command line: one ``error:`` line naming what to fix, exit 1, no traceback,
and nothing changed (no tenant suspended with its invalidation lost, no bootstrap key printed by a server
that then cannot listen)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import pytest

from loraplex.cli import main
from tests.conftest import ROOT


def closed_port() -> int:
    """A local port nothing listens on (connections are refused at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_line_error(rc: int, err: str, *needles: str) -> None:
    assert rc == 1, err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for needle in needles:
        assert needle in lines[0], err


@pytest.mark.parametrize("case", ["bad-url", "no-driver", "pg-down", "db-upgrade-pg-down", "redis-down",
                                  "typo-data-dir", "export-typo-data-dir", "data-dir-is-a-file", "bad-env"])
def test_setting_and_service_errors_are_one_line(case, tmp_path, capsys, monkeypatch):
    data = str(tmp_path / "data")
    down = f"postgresql+asyncpg://ops:s3cret@127.0.0.1:{closed_port()}/loraplex"
    (tmp_path / "a-file").write_text("")
    argv, needles = {
        "bad-url": (["admin", "tenant", "list", "--database-url", "foo://bar"],
                    ["database URL foo://bar is not usable", "postgresql+asyncpg://"]),
        "no-driver": (["admin", "tenant", "list", "--database-url", "postgresql://u@127.0.0.1/x"],
                      ["is not usable", "postgresql+asyncpg://"]),
        "pg-down": (["admin", "tenant", "list", "--database-url", down],
                    ["cannot connect to the database at postgresql+asyncpg://ops:***@127.0.0.1"]),
        "db-upgrade-pg-down": (["db", "upgrade", "--database-url", down], ["cannot connect to the database"]),
        "redis-down": (["admin", "tenant", "create", "acme", "--data-dir", data,
                        "--redis-url", f"redis://127.0.0.1:{closed_port()}/0"], ["cannot reach Redis at redis://"]),
        "typo-data-dir": (["admin", "tenant", "list", "--data-dir", data], [f"no Loraplex database in {data}"]),
        "export-typo-data-dir": (["usage", "export", "--data-dir", data], [f"no Loraplex database in {data}"]),
        "data-dir-is-a-file": (["admin", "tenant", "create", "acme", "--data-dir", str(tmp_path / "a-file")],
                               ["cannot be created", "--data-dir"]),
        "bad-env": (["admin", "tenant", "list", "--data-dir", data], ["LORAPLEX_MAX_LORAS='many' is not a valid integer"]),
    }[case]
    if case == "bad-env":
        monkeypatch.setenv("LORAPLEX_MAX_LORAS", "many")
    rc, _, err = run(capsys, *argv)
    assert_one_line_error(rc, err, *needles)
    assert "s3cret" not in err


def test_bad_log_level_is_one_line(capsys, monkeypatch):
    monkeypatch.setattr("loraplex.log._handler", None)
    rc, _, err = run(capsys, "--log-level", "chatty", "admin", "tenant", "list")
    assert_one_line_error(rc, err, "log level 'CHATTY'")


def test_unreachable_redis_changes_nothing(tmp_path, capsys):
    data = str(tmp_path / "data")
    rc, _, err = run(capsys, "admin", "tenant", "create", "acme", "--data-dir", data)
    assert rc == 0 and "created a new database" in err
    rc, _, err = run(capsys, "admin", "tenant", "suspend", "acme", "--data-dir", data,
                     "--redis-url", f"redis://127.0.0.1:{closed_port()}/0")
    assert_one_line_error(rc, err, "cannot reach Redis")
    rc, out, _ = run(capsys, "admin", "tenant", "list", "--data-dir", data, "--json")
    assert [t["status"] for t in json.loads(out)] == ["active"]  # not suspended behind the error


def serve(tmp_path, *args: str) -> subprocess.CompletedProcess:
    """``loraplex serve`` in a subprocess (a server that wrongly starts is stopped by the timeout)."""
    return subprocess.run([sys.executable, "-m", "loraplex.cli", "serve", "--data-dir", str(tmp_path / "d"), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_serve_checks_model_and_services_before_starting(tmp_path):
    proc = serve(tmp_path, str(tmp_path / "no-such-model"), "--port", "0")
    assert_one_line_error(proc.returncode, proc.stderr, "model directory", "does not exist")
    proc = serve(tmp_path, "--port", "0", "--redis-url", f"redis://127.0.0.1:{closed_port()}/0")
    assert_one_line_error(proc.returncode, proc.stderr, "cannot reach Redis")
    assert "Bootstrap admin key" not in proc.stdout


def test_serve_on_a_taken_port_fails_fast_and_prints_no_key(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        t0 = time.monotonic()
        proc = serve(tmp_path, "--port", str(port))
    assert_one_line_error(proc.returncode, proc.stderr, f"cannot listen on 127.0.0.1:{port}", "already in use")
    # the check comes before start-up work: no admin key shown (and lost), no demo model generated
    assert "Bootstrap admin key" not in proc.stdout
    assert not (tmp_path / "d" / "demo-model").exists()
    assert time.monotonic() - t0 < 30


def test_adapter_cli_without_a_server_names_the_url(capsys, monkeypatch):
    url = f"http://127.0.0.1:{closed_port()}"
    monkeypatch.delenv("LORAPLEX_URL", raising=False)
    rc, _, err = run(capsys, "adapter", "list", "--url", url, "--api-key", "lpx-x")
    assert_one_line_error(rc, err, f"cannot reach the server at {url}", "--url")


def test_a_refused_export_leaves_no_file_and_keeps_the_old_one(tmp_path, capsys):
    data = str(tmp_path / "data")
    assert run(capsys, "admin", "tenant", "create", "acme", "--data-dir", data)[0] == 0
    out = tmp_path / "usage.csv"
    rc, _, err = run(capsys, "usage", "export", "--data-dir", data, "--from", "2026-13-01", "-o", str(out))
    assert rc == 2 and "from must be an ISO 8601 date" in err
    assert not out.exists() and list(tmp_path.iterdir()) == [tmp_path / "data"]
    out.write_text("last month's export\n")
    rc, _, _ = run(capsys, "usage", "export", "--data-dir", data, "--to", "2000-01-01", "-o", str(out))
    assert rc == 2 and out.read_text() == "last month's export\n"
    assert run(capsys, "usage", "export", "--data-dir", data, "-o", str(out))[0] == 0
    assert out.read_text().startswith("tenant_id,tenant,day,")


@pytest.mark.parametrize("argv, flag, api_field", [
    (["admin", "tenant", "create", "acme2", "--requests-per-minute", "0"], "--requests-per-minute",
     "requests_per_minute"),
    (["admin", "tenant", "create", "acme2", "--tokens-per-minute", "-3"], "--tokens-per-minute", "tokens_per_minute"),
    (["admin", "tenant", "create", "acme2", "--requests-per-minute", "99999999999999999999"],
     "--requests-per-minute", "requests_per_minute"),
    (["admin", "tenant", "create", "acme2", "--tokens-per-minute", "2147483648"], "--tokens-per-minute",
     "tokens_per_minute"),
    (["admin", "key", "create", "--tenant", "acme", "--expires-in-days", "-1"], "--expires-in-days", "expires_at"),
    (["admin", "key", "create", "--tenant", "acme", "--expires-in-days", "0"], "--expires-in-days", "expires_at"),
    (["admin", "key", "create", "--tenant", "acme", "--expires-in-days", "nan"], "--expires-in-days", "expires_at"),
    (["admin", "key", "create", "--tenant", "acme", "--expires-in-days", "1e12"], "--expires-in-days", "expires_at"),
    (["admin", "key", "create", "--tenant", "acme", "--name", "tab\there"], "--name", "name must"),
    (["admin", "key", "create", "--tenant", "acme", "--scope", "admin"], "--scope", "'admin' scope"),
    (["admin", "key", "create", "--tenant", "nobody"], "--tenant", "No tenant"),
    (["usage", "export", "--group-by", "day", "--from", "2026-02-01", "--to", "2026-01-01"], "--to", "to must"),
])
def test_admin_errors_name_the_flag_the_operator_typed(argv, flag, api_field, tmp_path, capsys):
    """Errors of ``loraplex admin``/``usage export`` say ``--requests-per-minute``, not the API's field name."""
    data = str(tmp_path / "data")
    assert run(capsys, "admin", "tenant", "create", "acme", "--data-dir", data)[0] == 0
    rc, out, err = run(capsys, *argv, "--data-dir", data)
    assert rc in (1, 2) and out == "" and "Traceback" not in err, err
    line = err.strip()
    assert len(line.splitlines()) == 1 and line.startswith("error: ") and flag in line, err
    if "_" in api_field:
        assert api_field not in line, err
    rc, out, _ = run(capsys, "admin", "key", "list", "--data-dir", data, "--json")
    assert rc == 0 and json.loads(out) == []  # nothing was created behind the error


@pytest.mark.parametrize("argv, needles", [
    (["admin", "tenant", "create", "Bad_Name"], ["tenant name 'Bad_Name'", "lowercase"]),
    (["admin", "tenant", "create", "_x"], ["tenant name '_x'", "starting with a letter or digit"]),
    (["admin", "tenant", "create", "acme", "--requests-per-minute", "0"], ["--requests-per-minute", "at least 1"]),
    (["admin", "tenant", "create", "acme", "--tokens-per-minute", "2147483648"], ["--tokens-per-minute",
                                                                                   "2147483647"]),
    (["admin", "key", "create", "--tenant", "acme", "--expires-in-days", "0"], ["--expires-in-days", "36500"]),
])
def test_admin_refuses_a_bad_value_before_creating_a_database(argv, needles, tmp_path, capsys):
    """A value no run can use is exit 2 with nothing made: no data dir, no database, no "created a new database"."""
    data = tmp_path / "new-data"
    rc, out, err = run(capsys, *argv, "--data-dir", str(data))
    assert_flag_error(rc, err, *needles)
    assert out == "" and "created a new database" not in err
    assert not data.exists()


def assert_flag_error(rc: int, err: str, *needles: str) -> None:
    """A flag value no command can use: one ``error:`` line naming the flag and the limit, exit 2."""
    assert rc == 2, err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for needle in needles:
        assert needle in lines[0], err


@pytest.mark.parametrize("revision, needles", [
    ("nonexist", ["--revision", "nonexist", "0004_shares_by_name"]),
    ("", ["--revision", "empty"]),
    ("+99", ["--revision", "+99"]),
])
def test_db_upgrade_to_an_unknown_revision_is_one_line(revision, needles, tmp_path):
    data = tmp_path / "data"
    # a process of its own: alembic's import-time log lines would go to the real stderr
    proc = subprocess.run([sys.executable, "-m", "loraplex.cli", "db", "upgrade", "--revision", revision,
                           "--data-dir", str(data)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert_flag_error(proc.returncode, proc.stderr, *needles)
    assert proc.stdout == ""
    if revision != "+99":  # known to be wrong before the database is even opened: nothing created
        assert not data.exists()


@pytest.mark.parametrize("args, env, needles", [
    (["--port", "99999"], {}, ["--port", "65535", "99999"]),
    (["--port", "-1"], {}, ["--port", "65535"]),
    ([], {"LORAPLEX_PORT": "70000"}, ["LORAPLEX_PORT", "65535"]),
    (["--max-loras", "0"], {}, ["--max-loras", "at least 1"]),
    (["--max-loras", "99999999999999999999"], {}, ["--max-loras", "2147483647"]),
    (["--max-lora-rank", "-4"], {}, ["--max-lora-rank", "at least 1"]),
    (["--max-cpu-loras", "0"], {}, ["--max-cpu-loras", "at least 1"]),
    (["--max-num-seqs", "0"], {}, ["--max-num-seqs", "at least 1"]),
    (["--max-model-len", "1"], {}, ["--max-model-len", "at least 2"]),
    (["--num-kv-blocks", "0"], {}, ["--num-kv-blocks", "at least 1"]),
    (["--drain-timeout-s", "-1"], {}, ["--drain-timeout-s"]),
    (["--drain-timeout-s", "nan"], {}, ["--drain-timeout-s"]),
    (["--drain-timeout-s", "inf"], {}, ["--drain-timeout-s"]),
    (["--device", "tpu"], {}, ["--device", "tpu"]),
    (["--dtype", "float8"], {}, ["--dtype", "float8", "bfloat16"]),
    (["--kv-cache-dtype", "int4"], {}, ["--kv-cache-dtype", "int4", "fp8, fp8_e4m3, int8"]),
    ([], {"LORAPLEX_KV_CACHE_DTYPE": "fp16"}, ["LORAPLEX_KV_CACHE_DTYPE", "fp16", "int8"]),
    ([], {"LORAPLEX_LORA_EXPAND_FIRST_MIN_TOKENS": "-1"}, ["LORAPLEX_LORA_EXPAND_FIRST_MIN_TOKENS", ">= 0"]),
    (["--lora-gemm-shrink", "--lora-gemm-shrink-max-tokens", "0"], {},
     ["--lora-gemm-shrink-max-tokens", "LORAPLEX_LORA_GEMM_SHRINK_MAX_TOKENS", ">= 1"]),
    (["--lora-gemm-shrink-max-moves", "-1"], {},
     ["--lora-gemm-shrink-max-moves", "LORAPLEX_LORA_GEMM_SHRINK_MAX_MOVES", ">= 0"]),
    ([], {"LORAPLEX_LORA_GEMM_SHRINK_MAX_MOVES": "-2"}, ["LORAPLEX_LORA_GEMM_SHRINK_MAX_MOVES", ">= 0"]),
    (["--num-speculative-tokens", "-1"], {}, ["--num-speculative-tokens", "at least 0"]),
    (["--num-speculative-tokens", "17"], {}, ["--num-speculative-tokens", "at most 16"]),
    ([], {"LORAPLEX_NUM_SPECULATIVE_TOKENS": "2", "LORAPLEX_PROMPT_LOOKUP_MIN": "5"},
     ["LORAPLEX_PROMPT_LOOKUP_MIN", "<= prompt_lookup_max", "got 5 and 4"]),
    (["--quantization", "int4"], {}, ["--quantization", "int4", "int8, fp8"]),
])
def test_serve_refuses_impossible_flags_before_anything_starts(args, env, needles, tmp_path, monkeypatch):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    proc = serve(tmp_path, *args)
    assert_flag_error(proc.returncode, proc.stderr, *needles)
    assert "Bootstrap admin key" not in proc.stdout
    assert not (tmp_path / "d").exists()  # no data dir, database or demo model


@pytest.mark.parametrize("args, needles", [
    (["--timeout", "-5"], ["--timeout", "-5"]),
    (["--timeout", "0"], ["--timeout"]),
    (["--timeout", "nan"], ["--timeout"]),
    (["--timeout", "1e300"], ["--timeout", "86400"]),
    (["--url", "127.0.0.1:8000"], ["--url", "http://"]),
])
def test_adapter_upload_checks_its_flags_first(args, needles, tmp_path, capsys):
    rc, out, err = run(capsys, "adapter", "upload", "bot", str(tmp_path / "missing"), "--api-key", "lpx-x",
                       "--url", f"http://127.0.0.1:{closed_port()}", *args)
    assert_flag_error(rc, err, *needles)
    assert out == ""


def test_adapter_upload_of_a_missing_path_names_it(tmp_path, capsys):
    missing = tmp_path / "missing"
    rc, _, err = run(capsys, "adapter", "upload", "bot", str(missing), "--api-key", "lpx-x",
                     "--url", f"http://127.0.0.1:{closed_port()}")
    assert_flag_error(rc, err, str(missing), "does not exist")


def test_an_engine_stall_timeout_too_short_for_the_heartbeat_is_refused_naming_the_flag():
    from loraplex.platform.cli import FlagError
    from loraplex.platform.cli_serve import check_serve_settings
    from loraplex.settings import Settings

    for bad in (1.0, -1.0, float("nan")):
        with pytest.raises(FlagError, match="--engine-stall-timeout-s / LORAPLEX_ENGINE_STALL_TIMEOUT_S"):
            check_serve_settings(Settings(engine_stall_timeout_s=bad))
    for good in (0.0, 5.0, 600.0):
        check_serve_settings(Settings(engine_stall_timeout_s=good))
