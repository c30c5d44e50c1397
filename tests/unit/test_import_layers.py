"""The import arrows of ``src/jobrelay``, read from the source with ``ast``: no circles, and
the layers point one way:

    domain <- storage <- library <- runtime <- (worker, relay, maintenance, admin)
           <- api (and ``jobrelay.http``) <- processes <- cli

``library`` is the surface applications use (``App``, definitions, contexts, schedules, the
operation port); ``runtime`` is the wiring every process role is handed (the adapters picked
from settings, the heartbeat); ``processes`` holds the entry points that start the roles and
the API's server.

Every import counts, wherever it is written: at module level, inside a function, and under
``if TYPE_CHECKING:``. A circle hidden in a function body or behind ``TYPE_CHECKING`` is still
two modules that cannot be understood (or moved) one without the other, so hiding one is not
a way to pass. (An equivalent of import-linter's ``independence``/``forbidden`` contracts,
without a dependency for it.)
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = "jobrelay"

# The library surface: above storage, below every process-side package.
LIBRARY = "jobrelay.library"
# The process roles, each handed a runtime.
ROLES = ("jobrelay.worker", "jobrelay.relay", "jobrelay.maintenance", "jobrelay.admin")
# The HTTP API, and its public helpers for applications' own routes.
API = ("jobrelay.api", "jobrelay.http")
# The entry points that start the roles and the API's server, and the command line on top.
ENTRY = ("jobrelay.processes", "jobrelay.cli")


def _modules() -> dict[str, Path]:
    found = {}
    for path in (SRC / PACKAGE).rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imported(module: str, path: Path, modules: dict[str, Path]) -> Iterator[tuple[str, int]]:
    """(module imported, line) for every import in ``path``, at any depth."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            # ``from pkg import sub`` imports the module ``pkg.sub`` when there is one.
            names = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names
            ]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module:
                yield name, node.lineno


def _graph() -> dict[str, dict[str, int]]:
    modules = _modules()
    return {m: dict(_imported(m, path, modules)) for m, path in modules.items()}


GRAPH = _graph()


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph.get(node, {}):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _in(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def _arrows(*sources: str) -> list[tuple[str, str, int]]:
    return [
        (a, b, line)
        for a, targets in sorted(GRAPH.items())
        if _in(a, *sources)
        for b, line in sorted(targets.items())
    ]


def test_the_graph_is_read() -> None:
    # The walk itself: a known arrow of each kind is seen, so an empty graph cannot pass.
    assert "jobrelay.domain.states" in GRAPH["jobrelay.storage.records"]
    assert "jobrelay.storage.store" in GRAPH["jobrelay.runtime.wiring"]
    assert "jobrelay.api.factory" in GRAPH["jobrelay.processes.api_server"]
    assert len(GRAPH) > 150


def test_no_import_circles() -> None:
    assert _cycles(GRAPH) == []


def test_no_circle_between_folders() -> None:
    folders: dict[str, dict[str, int]] = {}
    for a, targets in GRAPH.items():
        fa = ".".join(a.split(".")[:2])
        for b in targets:
            fb = ".".join(b.split(".")[:2])
            if (
                fa != fb
                and (SRC / Path(*fa.split("."))).is_dir()
                and (SRC / Path(*fb.split("."))).is_dir()
            ):
                folders.setdefault(fa, {})[fb] = 0
    loops = [c for c in _cycles(folders) if {"jobrelay.storage", "jobrelay.transport"} <= set(c)]
    assert loops == []


def test_the_domain_imports_no_io_package() -> None:
    assert [
        arrow
        for arrow in _arrows("jobrelay.domain")
        if not _in(arrow[1], "jobrelay.domain", "jobrelay.errors")
    ] == []


@pytest.mark.parametrize(
    "forbidden",
    [
        "jobrelay.transport",
        LIBRARY,
        "jobrelay.runtime",
        *ROLES,
        *API,
        *ENTRY,
        "jobrelay.database_files",
        "jobrelay.exports",
        "jobrelay.chaos",
        "jobrelay.observe.metrics",
    ],
)
def test_storage_never_imports(forbidden: str) -> None:
    assert [arrow for arrow in _arrows("jobrelay.storage") if _in(arrow[1], forbidden)] == []


def test_the_library_imports_no_process_side_package() -> None:
    above = ("jobrelay.runtime", *ROLES, *API, *ENTRY, "jobrelay.exports")
    assert [arrow for arrow in _arrows(LIBRARY) if _in(arrow[1], *above)] == []


def test_the_runtime_imports_no_role() -> None:
    assert [
        arrow for arrow in _arrows("jobrelay.runtime") if _in(arrow[1], *ROLES, *API, *ENTRY)
    ] == []


@pytest.mark.parametrize("role", ROLES)
def test_roles_never_import_api_or_entry_points(role: str) -> None:
    assert [arrow for arrow in _arrows(role) if _in(arrow[1], *API, *ENTRY)] == []


@pytest.mark.parametrize(
    ("role", "others"),
    [
        ("jobrelay.worker", ("jobrelay.relay", "jobrelay.maintenance", "jobrelay.admin")),
        ("jobrelay.relay", ("jobrelay.worker", "jobrelay.maintenance", "jobrelay.admin")),
        # The operator tools use the maintenance loops (the scheduler, the quarantine scan),
        # never the other way round.
        ("jobrelay.maintenance", ("jobrelay.worker", "jobrelay.relay", "jobrelay.admin")),
    ],
)
def test_roles_stand_apart(role: str, others: tuple[str, ...]) -> None:
    assert [arrow for arrow in _arrows(role) if _in(arrow[1], *others)] == []


@pytest.mark.parametrize("api", API)
def test_the_api_never_imports_entry_points(api: str) -> None:
    assert [arrow for arrow in _arrows(api) if _in(arrow[1], *ENTRY)] == []


def test_entry_points_never_import_the_cli() -> None:
    assert [arrow for arrow in _arrows("jobrelay.processes") if _in(arrow[1], "jobrelay.cli")] == []


# Each database's driver modules; what both use (``drivers.compiled``, the port in
# ``drivers/__init__``, ``new_job``, ``dbapi``) belongs to neither.
POSTGRES_DRIVER = (
    "jobrelay.storage.drivers.postgres",
    "jobrelay.storage.drivers.pg_pool",
    "jobrelay.storage.drivers.pg_statements",
)
SQLITE_DRIVER = (
    "jobrelay.storage.drivers.sqlite",
    "jobrelay.storage.drivers.sqlite_conn",
    "jobrelay.storage.drivers.sqlite_local_queue",
    "jobrelay.storage.drivers.sqlite_statements",
)


@pytest.mark.parametrize(
    ("driver", "other"), [(POSTGRES_DRIVER, SQLITE_DRIVER), (SQLITE_DRIVER, POSTGRES_DRIVER)]
)
def test_drivers_never_import_each_other(driver: tuple[str, ...], other: tuple[str, ...]) -> None:
    assert all(module in GRAPH for module in driver)
    assert [arrow for arrow in _arrows(*driver) if _in(arrow[1], *other)] == []


def test_the_store_reaches_a_driver_only_through_the_port() -> None:
    """Outside ``storage/drivers``, nothing imports one database's driver: the store holds
    a ``Driver`` that ``open_driver`` chose."""
    outside = [
        arrow
        for arrow in _arrows("jobrelay")
        if not _in(arrow[0], "jobrelay.storage.drivers")
        and _in(arrow[1], *POSTGRES_DRIVER, *SQLITE_DRIVER)
    ]
    assert outside == []


def test_nothing_imports_the_testing_helpers() -> None:
    # ``jobrelay.testing`` sits on top (it opens a runtime and runs a relay and a worker):
    # a module below it importing it would be production code depending on test helpers.
    assert [
        arrow
        for arrow in _arrows(PACKAGE)
        if _in(arrow[1], "jobrelay.testing") and not _in(arrow[0], "jobrelay.testing")
    ] == []
    assert "jobrelay.worker.consumer" in GRAPH["jobrelay.testing.runner"]
