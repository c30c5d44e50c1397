"""A statement compiled once for the connections a driver holds (asyncpg's, ``sqlite3``'s).

Through SQLAlchemy every statement pays its compilation cache lookup and the connection's
wrapping; a worker runs the same few statements over and over, so each driver compiles them
once, here, with SQLAlchemy's own bind processors, and sends the text on its own connections.
Both drivers use it; neither imports the other.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy.engine import Dialect
from sqlalchemy.sql.expression import Executable


class CompiledStatement:
    """One SQLAlchemy statement compiled once for a driver's own connections: its text and
    how to bind it, as SQLAlchemy would (its bind processors)."""

    def __init__(self, statement: Executable, dialect: Dialect) -> None:
        compiled = statement.compile(dialect=dialect)  # type: ignore[attr-defined]
        self.statement = statement
        self.sql: str = compiled.string
        processors = compiled._bind_processors
        self._binds = tuple((name, processors.get(name)) for name in compiled.positiontup or ())

    def args(self, params: Mapping[str, Any]) -> list[Any]:
        """The positional arguments for ``params``, as SQLAlchemy would have bound them."""
        args: list[Any] = []
        for name, process in self._binds:
            value = params[name]
            args.append(value if process is None else process(value))
        return args


__all__ = ["CompiledStatement"]
