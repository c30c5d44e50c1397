"""The backend is named where a database is opened and inside its driver, nowhere else:
everywhere else code asks the store for a capability (``store.capabilities.leads``,
``capabilities_of(conn).copies``) or asks the driver (``store.driver``), never which database
this is. Read from the source with ``ast``, like ``test_import_layers``.

A question about the database's name outside storage is a branch a new backend would have to
find and extend by hand; a capability is one field the backend sets where it is opened.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "jobrelay"
STORAGE = SRC / "storage"

BACKEND_NAMES = {"postgresql", "postgres", "postgresql+asyncpg", "sqlite", "sqlite+aiosqlite"}

# Where a URL is read before anything is opened, its scheme is parsed there, and nowhere else:
# settings.py checks JOBRELAY_DATABASE_URL's scheme when the setting is read (a bad one is a
# one-line error before any connection); database_files.py finds the file an SQLite URL
# names, to refuse a missing one before aiosqlite would create it.
URL_READERS = {SRC / "settings.py", SRC / "database_files.py"}


def _names_backend(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return node.value in BACKEND_NAMES
    if isinstance(node, ast.Set | ast.Tuple | ast.List):
        return any(_names_backend(element) for element in node.elts)
    return False


def _questions(path: Path) -> Iterator[str]:
    """``file:line: source`` for every place ``path`` asks which database this is."""
    source = path.read_text()
    seen: set[int] = set()
    for node in ast.walk(ast.parse(source, str(path))):
        found = False
        if isinstance(node, ast.Attribute):
            found = node.attr == "is_postgres" or (
                node.attr == "name"
                and isinstance(node.value, ast.Attribute)
                and node.value.attr == "dialect"
            )
        elif isinstance(node, ast.Compare):
            found = any(_names_backend(side) for side in [node.left, *node.comparators])
        elif isinstance(node, ast.Call):
            found = (
                isinstance(node.func, ast.Attribute)
                and node.func.attr in {"startswith", "endswith"}
                and any(_names_backend(arg) for arg in node.args)
            ) or any(kw.arg == "drivername" and _names_backend(kw.value) for kw in node.keywords)
        lineno = getattr(node, "lineno", 0)
        if found and lineno not in seen:
            seen.add(lineno)
            yield f"{path.relative_to(SRC.parent)}:{lineno}: {ast.get_source_segment(source, node)}"


# Inside storage, the places that may name a backend: the drivers; where an engine is opened
# (engine.py) and its capabilities stated (capabilities.py); the schema's column types, each
# declared once with its per-dialect variants (column_types.py); and the Alembic migrations,
# which run against one database at a time.
NAMING_ALLOWED = {
    STORAGE / "drivers",
    STORAGE / "migrations",
    STORAGE / "engine.py",
    STORAGE / "capabilities.py",
    STORAGE / "column_types.py",
}


def _allowed(path: Path) -> bool:
    return any(path == place or place in path.parents for place in NAMING_ALLOWED)


def test_the_check_sees_a_question() -> None:
    # The drivers and the opening ask, so it shows the check is not blind.
    assert any(_questions(STORAGE / "drivers" / "__init__.py"))
    assert any(_questions(STORAGE / "engine.py"))


def test_no_store_module_outside_the_drivers_asks_which_database_this_is() -> None:
    asked = sorted(
        question
        for path in sorted(STORAGE.rglob("*.py"))
        if not _allowed(path)
        for question in _questions(path)
    )
    assert asked == []


def test_no_module_outside_storage_asks_which_database_this_is() -> None:
    asked = sorted(
        question
        for path in sorted(SRC.rglob("*.py"))
        if STORAGE not in path.parents and path not in URL_READERS
        for question in _questions(path)
    )
    assert asked == []


def test_each_backend_states_its_capabilities_where_it_is_opened() -> None:
    # Opened, not connected: the answers come from the engine's dialect alone.
    from jobrelay.storage.capabilities import POSTGRESQL, SQLITE, capabilities_of
    from jobrelay.storage.engine import create_engine

    postgres = create_engine("postgresql://nobody@127.0.0.1:1/none")
    sqlite = create_engine("sqlite:///:memory:")
    assert capabilities_of(postgres) == POSTGRESQL
    assert capabilities_of(sqlite) == SQLITE
    assert all(vars(POSTGRESQL).values()) and not any(vars(SQLITE).values())
