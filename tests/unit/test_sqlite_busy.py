"""SQLite's "still locked" is told apart from a database that cannot be reached (issue 34,
item 1): the first is an answer (``StoreBusy``: a lease renewal asks again, nobody can take
the claim over meanwhile), the second an outage (``StoreError``: a run whose lease may have
ended is stopped). Real sqlite3 errors, classified where the store classifies them."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from sqlalchemy.exc import OperationalError

from jobrelay.errors import StoreBusy, StoreError
from jobrelay.storage.engine import store_error


def _as_sqlalchemy(exc: sqlite3.Error) -> OperationalError:
    return OperationalError("BEGIN IMMEDIATE", {}, exc)


def test_a_write_lock_held_by_another_connection_is_busy(tmp_path: Path) -> None:
    path = tmp_path / "db.sqlite"
    holder = sqlite3.connect(path, isolation_level=None)
    other = sqlite3.connect(path, isolation_level=None, timeout=0)
    try:
        holder.execute("BEGIN IMMEDIATE")
        with pytest.raises(sqlite3.OperationalError) as locked:
            other.execute("BEGIN IMMEDIATE")
    finally:
        holder.close()
        other.close()
    error = store_error("database write failed", _as_sqlalchemy(locked.value))
    assert isinstance(error, StoreBusy) and "locked" in str(error)


def test_a_database_that_cannot_be_opened_is_an_outage_not_busy(tmp_path: Path) -> None:
    with pytest.raises(sqlite3.OperationalError) as unreachable:
        sqlite3.connect(tmp_path / "missing" / "db.sqlite")
    error = store_error("database write failed", _as_sqlalchemy(unreachable.value))
    assert isinstance(error, StoreError) and not isinstance(error, StoreBusy)
