"""Statements written once as a generator that yields each statement and receives its
result, so the same writes run on the caller's connection whatever it is: an asynchronous
SQLAlchemy connection (asyncpg, aiosqlite), a synchronous one (psycopg, sqlite3), or a
framework's DB-API connection (``drivers.dbapi``). Nothing here begins or commits."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator, Mapping
from typing import Any, TypeVar

from sqlalchemy import Connection, Executable
from sqlalchemy.ext.asyncio import AsyncConnection

T = TypeVar("T")
# One statement and its parameters (None: the values are in the statement).
Step = tuple[Executable, Mapping[str, Any] | None]
Steps = Generator[Step, Any, T]


async def run_async(conn: AsyncConnection, steps: Steps[T]) -> T:
    """Run ``steps`` on an asynchronous connection, inside whatever transaction it has."""
    return await run_on(conn.execute, steps)


async def run_on(
    execute: Callable[[Executable, Mapping[str, Any] | None], Awaitable[Any]], steps: Steps[T]
) -> T:
    """Run ``steps`` with ``execute``, which answers each statement with a result the steps
    can read (a SQLAlchemy result, or ``drivers.pg_pool.HotResult``)."""
    try:
        statement, params = next(steps)
        while True:
            statement, params = steps.send(await execute(statement, params))
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]


def run_sync(conn: Connection, steps: Steps[T]) -> T:
    """Run ``steps`` on a synchronous connection, inside whatever transaction it has."""
    try:
        statement, params = next(steps)
        while True:
            statement, params = steps.send(conn.execute(statement, params))
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]


__all__ = ["Step", "Steps", "run_async", "run_on", "run_sync"]
