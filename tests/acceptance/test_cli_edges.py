"""The ``jobrelay`` command at its edges, as a user meets it: every start-up failure is one
line ``jobrelay: error: …`` and exit code 2 (no traceback), and a mistyped path creates no
file anywhere."""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from jobrelay import __version__

from .procs import clean_env, run_cli

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
MIGRATIONS = ROOT / "src" / "jobrelay" / "storage" / "migrations" / "versions"


@pytest.fixture
def sqlite_env(tmp_path: Path, sqlite_template: Path) -> dict[str, str]:
    # A copy of the session's migrated template (`db upgrade` has tests of its own).
    shutil.copy(sqlite_template, tmp_path / "jr.db")
    env = clean_env(
        JOBRELAY_DATABASE_URL=f"sqlite:///{tmp_path}/jr.db",
        JOBRELAY_RESULTS_URL=f"file://{tmp_path}/exports",
    )
    return env


def assert_one_line(result: subprocess.CompletedProcess[str], *fragments: str) -> str:
    stderr = result.stderr.strip()
    assert result.returncode == 2, (result.returncode, stderr)
    assert stderr.startswith("jobrelay: error: "), stderr
    assert len(stderr.splitlines()) == 1 and "Traceback" not in stderr, stderr
    for fragment in fragments:
        assert fragment in stderr, (fragment, stderr)
    return stderr


def files_under(root: Path) -> set[Path]:
    return {p for p in root.rglob("*")}


def test_version() -> None:
    result = run_cli("--version", env=clean_env())
    assert (result.returncode, result.stdout) == (0, f"jobrelay {__version__}\n"), result.stderr


@pytest.mark.parametrize("command", ["api", "up"])
@pytest.mark.parametrize("port", ["0", "65536", "99999", "-1", "http"])
def test_a_bad_port_is_one_line(sqlite_env: dict[str, str], command: str, port: str) -> None:
    assert_one_line(run_cli(command, "--port", port, env=sqlite_env, timeout=30), "--port")


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


@pytest.mark.parametrize(
    ("command", "option"),
    [
        ("api", "--port"),
        ("up", "--port"),
        ("worker", "--metrics-port"),
        ("relay", "--metrics-port"),
    ],
)
def test_a_port_in_use_is_one_line(
    sqlite_env: dict[str, str], command: str, option: str, busy_port: int
) -> None:
    result = run_cli(command, option, str(busy_port), env=sqlite_env, timeout=30)
    assert_one_line(result, f"{option}: ", f"127.0.0.1:{busy_port}", "in use")


def test_a_host_that_does_not_resolve_is_one_line(sqlite_env: dict[str, str]) -> None:
    result = run_cli("api", "--host", "no-such-host.invalid", env=sqlite_env, timeout=30)
    assert_one_line(result, "--host", "no-such-host.invalid")


def test_usage_errors_are_one_line(sqlite_env: dict[str, str]) -> None:
    assert_one_line(run_cli("token", "create", "--bogus", env=sqlite_env), "--bogus")
    assert_one_line(run_cli("no-such-command", env=sqlite_env), "no-such-command")
    assert_one_line(run_cli("jobs", "list", "--limit", "x", env=sqlite_env), "--limit")


def test_an_account_with_a_trailing_newline_is_refused(sqlite_env: dict[str, str]) -> None:
    result = run_cli("token", "create", "--account", "acme\n", env=sqlite_env)
    assert_one_line(result, "--account")
    assert result.stdout == ""
    listed = run_cli("token", "list", "--json", env=sqlite_env)
    assert listed.returncode == 0 and listed.stdout.strip() == "[]", listed.stdout


@pytest.mark.parametrize(
    "args",
    [
        ("jobs", "list"),
        ("job", "show", "00000000-0000-0000-0000-000000000000"),
        ("token", "create", "--account", "acme"),
        ("seed",),
        ("db", "grant", "jobrelay_app"),
        ("worker",),
    ],
)
@pytest.mark.long
def test_a_command_on_a_new_sqlite_path_creates_nothing(
    tmp_path: Path, args: tuple[str, ...]
) -> None:
    for url, path in (
        (f"sqlite:///{tmp_path}/typo.db", tmp_path / "typo.db"),
        (f"sqlite:///{tmp_path}/missing/typo.db", tmp_path / "missing" / "typo.db"),
        (None, tmp_path / "var" / "jobrelay.db"),  # the default, relative to the cwd
    ):
        settings = {"JOBRELAY_RESULTS_URL": f"file://{tmp_path}/exports"}
        env = clean_env(**settings, **({"JOBRELAY_DATABASE_URL": url} if url else {}))
        result = run_cli(*args, env=env, cwd=tmp_path)
        assert_one_line(result, "JOBRELAY_DATABASE_URL", str(path.name), "jobrelay db upgrade")
        assert files_under(tmp_path) == set(), files_under(tmp_path)


def test_db_upgrade_makes_the_file_but_never_a_directory(tmp_path: Path) -> None:
    missing = run_cli(
        "db", "upgrade", "--database-url", f"sqlite:///{tmp_path}/no/jr.db", env=clean_env()
    )
    assert_one_line(missing, "JOBRELAY_DATABASE_URL", f"{tmp_path}/no")
    a_directory = run_cli(
        "db", "upgrade", "--database-url", f"sqlite:///{tmp_path}", env=clean_env()
    )
    assert_one_line(a_directory, "JOBRELAY_DATABASE_URL")
    bad_scheme = run_cli(
        "db", "upgrade", "--database-url", f"mysql:///{tmp_path}/x.db", env=clean_env()
    )
    assert_one_line(bad_scheme, "JOBRELAY_DATABASE_URL")
    assert files_under(tmp_path) == set(), files_under(tmp_path)

    made = run_cli(
        "db", "upgrade", "--database-url", f"sqlite:///{tmp_path}/jr.db", env=clean_env()
    )
    assert made.returncode == 0, made.stderr
    assert (tmp_path / "jr.db").is_file()


def test_db_upgrade_on_the_default_makes_its_var_directory(tmp_path: Path) -> None:
    made = run_cli("db", "upgrade", env=clean_env(), cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    assert (tmp_path / "var" / "jobrelay.db").is_file()


def test_the_cli_reference_names_the_real_migration_head() -> None:
    heads = sorted(p.name.split("_")[0] for p in MIGRATIONS.glob("[0-9][0-9][0-9][0-9]_*.py"))
    cli_md = (ROOT / "docs" / "reference" / "cli.md").read_text()
    named = re.findall(r"database schema at revision (\w+)", cli_md)
    assert named and set(named) == {heads[-1]}, (named, heads[-1])


def test_seed_after_the_demo_keeps_the_demo_ledgers(sqlite_env: dict[str, str]) -> None:
    first = run_cli("seed", "--rows-per-month", "5", env=sqlite_env)
    assert first.returncode == 0, first.stderr
    assert "acme: 180 ledger rows" in first.stdout  # 5 rows x 36 months
    again = run_cli("seed", env=sqlite_env)  # no size given: what is there stays
    assert again.returncode == 0, again.stderr
    assert "already seeded" in again.stdout and "5 rows per month" in again.stdout
    smaller = run_cli("seed", "--rows-per-month", "3", env=sqlite_env)
    assert_one_line(smaller, "5 rows per month", "--replace")
    same = run_cli("seed", "--rows-per-month", "5", env=sqlite_env)
    assert same.returncode == 0 and "already seeded" in same.stdout, same.stderr
    replaced = run_cli("seed", "--rows-per-month", "3", "--replace", env=sqlite_env)
    assert replaced.returncode == 0 and "acme: 108 ledger rows" in replaced.stdout, replaced


MULTI_HOST_URL = "postgresql://u@h1:5432,h2:54x2/db?target_session_attrs=read-write"  # a bad port


@pytest.mark.parametrize(
    "args",
    [
        ("db", "upgrade"),
        ("db", "grant", "jobrelay_app"),
        ("jobs", "list"),
        ("job", "show", "00000000-0000-0000-0000-000000000000"),
        ("token", "create", "--account", "acme"),
        ("schedules", "list"),
        ("prune",),
        ("worker",),
        ("up",),
    ],
)
def test_a_database_url_with_a_bad_host_list_is_one_line(
    tmp_path: Path, args: tuple[str, ...]
) -> None:
    # Every command reads the URL through the settings: one line naming the variable and
    # what is wrong, never `invalid literal for int()`. Several hosts are libpq's form (issue
    # 38): a port that is not a number, in any of them, is the same one line.
    for url in (MULTI_HOST_URL, "postgresql://u@h1:port/db", "postgresql://u@h1:5432,/db"):
        result = run_cli(*args, "--database-url", url, env=clean_env(), cwd=tmp_path, timeout=30)
        stderr = assert_one_line(result, "JOBRELAY_DATABASE_URL")
        assert "port" in stderr or "empty host" in stderr, stderr
    assert files_under(tmp_path) == set(), files_under(tmp_path)


@pytest.mark.rabbitmq
def test_broker_declare_over_a_queue_with_the_old_delivery_limit_says_how_to_choose(
    sqlite_env: dict[str, str], amqp_url: str
) -> None:
    """The default delivery limit went from 5 to 50; a queue declared with 5 keeps it (a
    queue argument cannot change in place): one line naming the queue's limit and both ways
    out, exit 2, and the queue as it was."""
    env = {**sqlite_env, "JOBRELAY_BROKER_URL": amqp_url}
    old = run_cli("broker", "declare", env={**env, "JOBRELAY_DELIVERY_LIMIT": "5"})
    assert old.returncode == 0, old.stderr
    refused = run_cli("broker", "declare", env=env)
    assert_one_line(
        refused,
        "topology mismatch: queue jobrelay.work exists with delivery limit 5",
        "set JOBRELAY_DELIVERY_LIMIT=5 to keep the queue as it is",
    )
    assert "unreachable" not in refused.stderr
    kept = run_cli("broker", "declare", env={**env, "JOBRELAY_DELIVERY_LIMIT": "5"})
    assert kept.returncode == 0, kept.stderr
