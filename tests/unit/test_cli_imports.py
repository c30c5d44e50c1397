"""The ``jobrelay`` command tree imports only what a command needs (issue 22, item 5).

Every test that runs ``jobrelay`` pays its start-up, and so does every operator typing
``jobrelay --help``: the command modules import the runtime (SQLAlchemy, aio-pika, the
API) inside the commands that run it. Checked on ``sys.modules`` in a fresh interpreter,
not by a timing.
"""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = (
    "sqlalchemy",
    "aio_pika",
    "fastapi",
    "jobrelay.runtime.wiring",
    "jobrelay.library.app",
    "boto3",
)


def _modules_after(code: str) -> set[str]:
    probe = f"{code}\nimport sys, json\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    return set(json.loads(out.strip().splitlines()[-1]))


def _heavy(modules: set[str]) -> set[str]:
    return {m for m in modules if any(m == h or m.startswith(h + ".") for h in HEAVY)}


def test_the_command_tree_imports_no_runtime() -> None:
    assert _heavy(_modules_after("import jobrelay.cli.main")) == set()


# What ``jobrelay worker`` and ``jobrelay relay`` import before they are ready (issue 23,
# item 8), and what only the API, the migrations and the exports need.
PROCESSES = (
    "import jobrelay.cli.main, jobrelay.processes.entry_points, jobrelay.worker.consumer, "
    "jobrelay.relay.publisher, jobrelay.maintenance.reconcile, jobrelay.maintenance.scheduler"
)
NOT_FOR_WORKERS = (
    "uvicorn",
    "httptools",
    "fastapi",
    "starlette",
    "jobrelay.api",
    "jobrelay.processes.http_guard",
    "jobrelay.processes.api_server",
    "alembic",
    "mako",
    "jobrelay.exports",
)


def test_the_worker_and_the_relay_import_no_http_server_and_no_migrations() -> None:
    modules = _modules_after(PROCESSES)
    assert {m for m in modules if m.startswith(NOT_FOR_WORKERS)} == set()


def test_the_package_imports_its_public_names_on_first_use() -> None:
    assert _heavy(_modules_after("import jobrelay")) == set()
    loaded = _modules_after("import jobrelay\njobrelay.App")
    assert "jobrelay.library.app" in loaded


def test_every_public_name_resolves() -> None:
    import jobrelay

    for name in jobrelay.__all__:
        assert getattr(jobrelay, name) is not None, name
    assert jobrelay.Job.__name__ == "JobRecord"


def test_every_command_summary_is_one_line() -> None:
    """The command list shows a command's first help paragraph with its line breaks: a
    summary wrapped at the source's 100 columns breaks mid-sentence in a wide terminal."""
    import typer.main

    from jobrelay.cli.main import app

    found: list[tuple[str, object]] = []

    def walk(command: object, path: str) -> None:
        for name, sub in getattr(command, "commands", {}).items():
            walk(sub, f"{path} {name}")
        found.append((path, command))

    walk(typer.main.get_command(app), "jobrelay")
    assert len(found) > 30  # the whole tree, groups and commands
    broken = {
        path: summary
        for path, command in found
        if "\n" in (summary := (getattr(command, "help", None) or "").strip().split("\n\n")[0])
    }
    assert broken == {}
