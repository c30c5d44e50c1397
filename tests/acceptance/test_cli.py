"""The ``jobrelay`` command as a user meets it: exit codes, one-line errors, nothing half-made."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from .procs import clean_env, run_cli

pytestmark = pytest.mark.slow


@pytest.fixture
def sqlite_env(tmp_path: Path, sqlite_template: Path) -> dict[str, str]:
    # A copy of the session's migrated template (`db upgrade` has tests of its own).
    shutil.copy(sqlite_template, tmp_path / "jr.db")
    env = clean_env(
        JOBRELAY_DATABASE_URL=f"sqlite:///{tmp_path}/jr.db",
        JOBRELAY_RESULTS_URL=f"file://{tmp_path}/exports",
    )
    return env


def assert_one_line_error(result: object, variable: str) -> None:
    stderr = result.stderr.strip()  # type: ignore[attr-defined]
    assert result.returncode == 2, stderr  # type: ignore[attr-defined]
    assert stderr.startswith(f"jobrelay: error: {variable}: "), stderr
    assert len(stderr.splitlines()) == 1 and "Traceback" not in stderr


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("JOBRELAY_DATABASE_URL", "mysql://root@localhost/x"),
        ("JOBRELAY_DATABASE_URL", "postgresql://postgres@127.0.0.1:1/nope"),
        ("JOBRELAY_BROKER_URL", "kafka://localhost"),
        ("JOBRELAY_BROKER_URL", "amqp://guest:guest@127.0.0.1:1/"),
        ("JOBRELAY_MAX_ATTEMPTS", "lots"),
        ("JOBRELAY_FAULTS", "export.run:explode"),
        ("JOBRELAY_APP", "no_such_module_anywhere:app"),
        ("JOBRELAY_APP", "no-colon-here"),
        ("JOBRELAY_APP", "json:dumps"),  # importable, but not a jobrelay.App
    ],
)
def test_bad_or_unreachable_settings_fail_in_one_line(
    variable: str, value: str, tmp_path: Path
) -> None:
    settings = {
        "JOBRELAY_DATABASE_URL": f"sqlite:///{tmp_path}/never.db",
        "JOBRELAY_RESULTS_URL": f"file://{tmp_path}/exports",
    }
    env = clean_env(**{**settings, variable: value})
    assert_one_line_error(run_cli("worker", env=env, cwd=tmp_path), variable)
    assert not (tmp_path / "never.db").exists()  # nothing half-created
    assert not (tmp_path / "var").exists()


def test_option_overrides_environment(tmp_path: Path) -> None:
    env = clean_env(JOBRELAY_MAX_ATTEMPTS="lots")
    result = run_cli(
        "db",
        "upgrade",
        "--max-attempts",
        "4",
        "--database-url",
        f"sqlite:///{tmp_path}/o.db",
        env=env,
    )
    assert result.returncode == 0, result.stderr
    assert "revision" in result.stdout


def test_token_create_prints_token_alone_on_last_line(sqlite_env: dict[str, str]) -> None:
    result = run_cli("token", "create", "--account", "acme", env=sqlite_env)
    assert result.returncode == 0, result.stderr
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("jr_") and " " not in last and len(last) > 30
    missing = run_cli("token", "create", env=sqlite_env)
    assert missing.returncode == 2 and "--account" in missing.stderr


def test_job_show_and_list(sqlite_env: dict[str, str]) -> None:
    unknown = run_cli("job", "show", "00000000-0000-0000-0000-000000000000", env=sqlite_env)
    assert unknown.returncode == 1 and "no job" in unknown.stderr
    bad_state = run_cli("jobs", "list", "--state", "sleeping", env=sqlite_env)
    assert bad_state.returncode == 2 and "queued" in bad_state.stderr
    listed = run_cli("jobs", "list", "--state", "queued", env=sqlite_env)
    assert listed.returncode == 0 and "0 job(s)" in listed.stdout


def test_unmigrated_database_is_named(tmp_path: Path) -> None:
    env = clean_env(JOBRELAY_DATABASE_URL=f"sqlite:///{tmp_path}/empty.db")
    result = run_cli("jobs", "list", env=env)
    assert_one_line_error(result, "JOBRELAY_DATABASE_URL")
    assert "jobrelay db upgrade" in result.stderr


def test_prune_counts_and_refuses_a_bad_age_in_one_line(sqlite_env: dict[str, str]) -> None:
    bogus = run_cli("prune", "--older-than", "bogus", env=sqlite_env)
    assert bogus.returncode == 2 and bogus.stdout == ""
    assert bogus.stderr.startswith("jobrelay: error: --older-than 'bogus': ")
    assert len(bogus.stderr.strip().splitlines()) == 1 and "Traceback" not in bogus.stderr
    dry = run_cli("prune", "--dry-run", env=sqlite_env)
    assert dry.returncode == 0 and "nothing changed" in dry.stdout
    assert dry.stdout.startswith("prune, older than 30 day(s): ")  # the retention setting
    minute = run_cli("prune", "--dry-run", "--older-than", "1m", env=sqlite_env)
    # The age as given, not "0.000694444 day(s)".
    assert minute.returncode == 0 and minute.stdout.startswith("prune, older than 1m: ")
    assert "jobs             0" in dry.stdout.splitlines()


@pytest.mark.long
def test_seed_fills_one_account_month_and_refuses_bad_input(
    sqlite_env: dict[str, str], tmp_path: Path
) -> None:
    import sqlite3

    def month_rows() -> list[tuple[str, str, int]]:
        with sqlite3.connect(tmp_path / "jr.db") as db:
            return db.execute(
                "SELECT account_id, period, count(*) FROM ledger_entries"
                " GROUP BY account_id, period"
            ).fetchall()

    args = ("seed", "--account", "acme", "--period", "2021-06", "--rows", "5000")
    for _ in range(2):  # a second run replaces the month: still 5000
        done = run_cli(*args, env=sqlite_env)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip().splitlines()[-1] == "acme 2021-06: 5000 ledger rows"
        assert month_rows() == [("acme", "2021-06", 5000)]
    with sqlite3.connect(tmp_path / "jr.db") as db:
        hostile = db.execute(
            "SELECT count(*) FROM ledger_entries WHERE description LIKE '=HYPERLINK%'"
        ).fetchone()
    assert hostile is not None and hostile[0] > 0

    for bad, named in [
        (("--account", "acme", "--period", "2021-13", "--rows", "10"), "--period"),
        (("--account", "Not An Account", "--period", "2021-06", "--rows", "10"), "--account"),
        (("--account", "acme", "--period", "2021-06"), "--rows"),
    ]:
        refused = run_cli("seed", *bad, env=sqlite_env)
        stderr = refused.stderr.strip()
        assert refused.returncode == 2 and stderr.startswith("jobrelay: error: "), stderr
        assert named in stderr and len(stderr.splitlines()) == 1
        assert month_rows() == [("acme", "2021-06", 5000)]  # nothing changed

    # A month of other rows is not the sample: the plain seed keeps it unless --replace.
    kept = run_cli("seed", "--rows-per-month", "2", env=sqlite_env)
    assert kept.returncode == 2 and "--replace" in kept.stderr, kept.stderr
    assert month_rows() == [("acme", "2021-06", 5000)]
    plain = run_cli("seed", "--rows-per-month", "2", "--replace", env=sqlite_env)
    assert plain.returncode == 0 and "acme: 72 ledger rows" in plain.stdout
