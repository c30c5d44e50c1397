"""How the benches see a phase end: counts read through the partial indexes the product keeps.

Every bench polls the database every 50 ms while it measures, on the two cores it measures.
Counting every job by state (a sequential scan of every job) or every outbox row with
``published_at IS NULL`` (which matches none of the relay's partial indexes, so every row's
body is read) took a quarter of a core of PostgreSQL in the export drain, charged to
jobrelay and never to the bare export or the peers (``pg_stat_activity`` sampled). These read
``ix_jobs_account_unfinished`` (only the unfinished jobs) and the relay's outbox indexes.
The full count by state runs once every job has finished, and once a second meanwhile, so a
quarantine still ends a phase at once (``QUARANTINE_LOOK_SECONDS``).

This module imports no application (``bench_app``): its job types would otherwise join the
registry of whatever process imports it, a test's among them.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

# Faster than any phase here runs (the drain's best is under 5,000 jobs/s): a probe that saw
# K jobs left waits K / FASTEST_RATE more before its next look, as they cannot all be done
# sooner, so the end is still seen within a poll and the first seconds of a phase, when the
# count is largest, are not spent counting.
FASTEST_RATE = 50_000.0
QUARANTINE_LOOK_SECONDS = 1.0

# Quarantined and cancelled jobs are finished too (``finished_at`` is stamped at the end).
UNFINISHED = "SELECT count(*) FROM jobs WHERE finished_at IS NULL"

# The unpublished rows, through the relay's partial indexes (``storage.tables``): due when
# written, held for a time, awaiting admission and not held (a row held for a time while it
# awaits admission is in two of them; the third count leaves it out).
UNPUBLISHED = (
    "SELECT (SELECT count(*) FROM outbox WHERE published_at IS NULL AND available_at IS NULL"
    " AND awaiting_admission IS false)"
    " + (SELECT count(*) FROM outbox WHERE published_at IS NULL AND available_at IS NOT NULL)"
    " + (SELECT count(*) FROM outbox WHERE published_at IS NULL AND awaiting_admission IS true"
    " AND available_at IS NULL)"
)


def sqlite_succeeded(path: Path, by_state: bool = True) -> tuple[int, int, int]:
    """Jobs succeeded, quarantined and unfinished in the SQLite file at ``path``; the first
    two only once none is unfinished or when asked (``by_state``), else 0."""
    with sqlite3.connect(path) as db:
        (unfinished,) = db.execute(UNFINISHED).fetchone()
        if unfinished and not by_state:
            return 0, 0, int(unfinished)
        rows = dict(db.execute("SELECT state, count(*) FROM jobs GROUP BY state").fetchall())
    return int(rows.get("succeeded", 0)), int(rows.get("quarantined", 0)), int(unfinished)
