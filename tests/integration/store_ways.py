"""The four ways a store sends its statements, for the tests of the store's port.

A store on SQLite writes through SQLAlchemy, or, while a worker holds it, on one plain ``sqlite3``
connection (``storage/drivers/sqlite_conn.py``); on PostgreSQL through SQLAlchemy, or on the asyncpg
connections a worker or relay holds (``storage/drivers/pg_pool.py``) and those the API holds for
its accepts (``PostgresDriver.intake``). ``way`` runs a test on each
(River's ``riverdrivertest.Exercise``, Oban's per-engine modules); ``holding`` holds a store's
connections as the worker does and says how many statements went on them.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable

import pytest

from jobrelay.storage.store import Store

WAYS = ["sqlite", "sqlite-held", "sqlalchemy", "asyncpg"]


@pytest.fixture(params=WAYS, name="way")
def way_fixture(request: pytest.FixtureRequest) -> tuple[str, str]:
    """(database URL, how the statements are sent); resolved outside the loop."""
    sqlite = request.param.startswith("sqlite")
    url = request.getfixturevalue("sqlite_url" if sqlite else "pg_url")
    return url, request.param


def held_way(how: str) -> bool:
    return how in ("sqlite-held", "asyncpg")


@contextlib.asynccontextmanager
async def holding(store: Store, how: str) -> AsyncIterator[Callable[[], int]]:
    """``store``'s hot connections held for the block where ``how`` says so, as a worker
    holds them (``worker/consumer.py``); gives the count of what was sent on them so far (0
    when nothing is held), so a test can tell the held executor did the work."""
    if not held_way(how):
        yield lambda: 0
        return
    # The API's intake connections too (a new job's writes): held the same way.
    async with store.hot_connections(), store.intake_connections():
        if how == "asyncpg":
            pool, intake = store.driver.hot, store.driver.intake
            assert pool is not None and pool.active, "the asyncpg connections are not held"
            assert intake.active, "the intake connections are not held"
            yield lambda: pool.sent + intake.sent
        else:
            conn = store.driver.hot
            assert conn is not None and conn.active, "the sqlite3 connection is not held"
            yield lambda: conn.sent
