"""The batched claims and completions on SQLite: one write transaction per batch, each
statement's text fixed and compiled once.

``batches`` sends a batch as one statement over arrays on PostgreSQL. SQLite has no arrays,
and no network to save round trips on: what costs there is the commit (the write lock
taken and given back; at ``synchronous=NORMAL`` in WAL no fsync per commit, as for every
write there) and the Python per statement. So a batch is ONE write transaction of few
statements: three for a batch of claims, two for a batch of completions.

The batch goes in as ONE bound value, a JSON array read by ``json_each`` (SQLite's
``unnest``): the text of each statement is the same for 1 and for 100 jobs, so SQLAlchemy
compiles it once and caches it, and a batch costs no Python per row beyond its JSON (a
statement built per batch, with a fence and a ``CASE`` arm per row, was about half the
embedded default's CPU). The guards are the policy's (``claims``: ``claimable``,
``fenced``), written over the request's columns as the PostgreSQL statements write them,
with the same events and the same answers: each job wins or loses on its own.

A row that cannot be stored fails the transaction, all of it rolled back, with a
``StoreDataError``: the worker's batcher then sends each request alone, so only that job
fails. Nothing of a batch is acked before it has committed.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, TypeVar

from sqlalchemy import Column, String, Text, bindparam, literal_column, text
from sqlalchemy.engine import Connection

from jobrelay import fastjson
from jobrelay.domain.policy import RETRY_SLACK
from jobrelay.domain.states import JobState
from jobrelay.errors import StoreDataError
from jobrelay.storage.base import StoreBase
from jobrelay.storage.claims import claimable_delivered, fenced, guard_sql
from jobrelay.storage.hot_path import COMPLETABLE, HotPathStore, result_saved_detail
from jobrelay.storage.records import Claim, JobRecord, job_record, jsonable
from jobrelay.storage.sqlite_hot import DIALECT, RowReader, run, sqlite_statement
from jobrelay.storage.storable import outcome_json, safe_text
from jobrelay.storage.tables import UTCDateTime, jobs

T = TypeVar("T")


def _req(*fields: str) -> str:
    """The request array as rows: ``json_each`` of ``:reqs``, element i named ``fields[i]``."""
    columns = ", ".join(f"json_extract(value, '$[{i}]') AS {f}" for i, f in enumerate(fields))
    return f"(SELECT {columns} FROM json_each(:reqs)) AS req"


def _req_column(name: str) -> Any:
    return literal_column(f"req.{name}")


def _by_id(guard: str) -> str:
    """The guard with ``jobs.state`` kept out of index choice (SQLite's unary ``+``).

    Without statistics SQLite's planner takes ``state IN (…)`` as more selective than the
    join on the primary key with ``json_each``, and scans every queued job once per request
    (19 ms a batch of 15 at 3,000 queued, measured); so the batch's ids drive the lookup."""
    return guard.replace("jobs.state", "+jobs.state")


_CLAIMABLE = _by_id(
    guard_sql(
        claimable_delivered(
            literal_column(":now", UTCDateTime()), literal_column(":due_by", UTCDateTime())
        ),
        DIALECT,
    )
)
_FENCE = _by_id(
    guard_sql(
        [
            StoreBase.state_in(COMPLETABLE),
            *fenced(Claim(_req_column("id"), _req_column("attempt"), _req_column("worker"))),
        ],
        DIALECT,
    )
)
_JOB_COLUMNS = ", ".join(f"jobs.{c.name}" for c in jobs.c)

_STATES = text(
    f"SELECT jobs.id, jobs.state FROM jobs, {_req('id', 'type')} "
    "WHERE jobs.id = req.id AND jobs.type = req.type"
).columns(Column("id", String()), Column("state", String()))

_CLAIM = (
    text(
        f"""
UPDATE jobs SET
    state = '{JobState.RUNNING.value}', updated_at = :updated_at, attempt = jobs.attempt + 1,
    lease_owner = req.worker, lease_expires_at = :lease_ends,
    next_attempt_at = NULL, progress_done = NULL, progress_total = NULL
FROM {_req("id", "type", "worker")}
WHERE jobs.id = req.id AND jobs.type = req.type AND {_CLAIMABLE}
RETURNING {_JOB_COLUMNS}
"""
    )
    .bindparams(
        bindparam("updated_at", type_=UTCDateTime()),
        bindparam("lease_ends", type_=UTCDateTime()),
        bindparam("now", type_=UTCDateTime()),
        bindparam("due_by", type_=UTCDateTime()),
    )
    .columns(*(Column(c.name, c.type) for c in jobs.c))
)

_COMPLETE = (
    text(
        f"""
UPDATE jobs SET
    state = '{JobState.SUCCEEDED.value}', updated_at = :updated_at,
    result_key = req.result_key, result_meta = req.meta,
    lease_owner = NULL, lease_expires_at = NULL, last_error = NULL
FROM {_req("id", "attempt", "worker", "result_key", "meta")}
WHERE jobs.id = req.id AND {_FENCE}
RETURNING jobs.id
"""
    )
    .bindparams(bindparam("updated_at", type_=UTCDateTime()))
    .columns(Column("id", String()))
)

# The events of a batch: (job id, detail as JSON) pairs; the detail's text is stored as is,
# as the JSON column stores what it serialises.
_EVENTS = text(
    """
INSERT INTO job_events (job_id, at, kind, detail)
SELECT json_extract(value, '$[0]'), :at, :kind, json_extract(value, '$[1]')
FROM json_each(:reqs)
"""
).bindparams(bindparam("at", type_=UTCDateTime()), bindparam("kind", type_=Text()))


@dataclass(frozen=True)
class ClaimRequest:
    job_id: str
    job_type: str
    worker_id: str
    detail: dict[str, Any]


@dataclass(frozen=True)
class CompleteRequest:
    claim: Claim
    result_key: str | None
    result_meta: dict[str, Any]


def _bindable(result_key: str | None) -> str | None:
    """The key as SQLite's driver would bind it, or StoreDataError: a lone surrogate cannot
    be UTF-8 (bound alone, the driver refuses it; inside the batch's JSON, escaped, SQLite
    would store something else)."""
    if result_key is not None:
        try:
            result_key.encode()
        except UnicodeEncodeError as exc:
            raise StoreDataError(
                f"the result key {safe_text(result_key)!r} is not UTF-8: {exc.reason}"
            ) from None
    return result_key


class _Statement:
    """A batch statement, its SQLite compilation for the held connection, and how its rows
    are read: by the columns it declares (``text(…).columns``), the same types on either
    path; a statement that declares none returns no rows."""

    def __init__(self, statement: Any) -> None:
        self.statement = statement
        self.hot = sqlite_statement(statement)
        columns = getattr(statement, "selected_columns", None)
        self.reader = RowReader(columns) if columns is not None else None


# A statement run inside the batch's transaction: its rows, each a mapping by column name.
Execute = Callable[[_Statement, Mapping[str, Any]], list[Mapping[str, Any]]]

_STATES_RUN = _Statement(_STATES)
_CLAIM_RUN = _Statement(_CLAIM)
_COMPLETE_RUN = _Statement(_COMPLETE)
_EVENTS_RUN = _Statement(_EVENTS)


def _on_held(conn: sqlite3.Connection) -> Execute:
    """Statements on the worker's held connection, in its thread (``sqlite_hot``)."""

    def execute(statement: _Statement, params: Mapping[str, Any]) -> list[Mapping[str, Any]]:
        rows = run(conn, statement.hot, params)
        return statement.reader.read(rows) if statement.reader is not None else []

    return execute


def _on_sqlalchemy(conn: Connection) -> Execute:
    """The same statements through SQLAlchemy (a store used without a running worker)."""

    def execute(statement: _Statement, params: Mapping[str, Any]) -> list[Mapping[str, Any]]:
        result = conn.execute(statement.statement, params)
        return [dict(row) for row in result.mappings()] if statement.reader is not None else []

    return execute


def _claim_tx(
    execute: Execute, requests: Sequence[ClaimRequest], params: dict[str, Any], now: datetime
) -> tuple[dict[str, str], dict[str, Mapping[str, Any]]]:
    asked = {r.job_id: r for r in requests}
    left = {row["id"]: row["state"] for row in execute(_STATES_RUN, params)}
    won = {row["id"]: row for row in execute(_CLAIM_RUN, params)}
    if won:
        events = [
            [
                job_id,
                {
                    "worker": asked[job_id].worker_id,
                    "attempt": int(row["attempt"]),
                    **asked[job_id].detail,
                },
            ]
            for job_id, row in won.items()
        ]
        execute(
            _EVENTS_RUN,
            {"reqs": fastjson.dumps(jsonable_rows(events)), "at": now, "kind": "claimed"},
        )
    return left, won


def _complete_tx(
    execute: Execute, requests: Sequence[CompleteRequest], reqs: str, now: datetime
) -> set[str]:
    ids = {row["id"] for row in execute(_COMPLETE_RUN, {"reqs": reqs, "updated_at": now})}
    won = [r for r in requests if r.claim.job_id in ids]
    if won:
        events = [
            [r.claim.job_id, result_saved_detail(r.claim, r.result_key, r.result_meta)] for r in won
        ]
        execute(
            _EVENTS_RUN,
            {"reqs": fastjson.dumps(jsonable_rows(events)), "at": now, "kind": "result_saved"},
        )
    return {r.claim.job_id for r in won}


class SqliteBatches(HotPathStore):
    async def _sqlite_tx(self, work: Callable[[Execute], T]) -> T:
        """``work`` in one write transaction: on the held connection in one hand-off to its
        thread while a worker runs (``sqlite_hot``), else through SQLAlchemy."""
        hot = self.sqlite_hot
        if hot is not None and hot.active:
            return await hot.transaction(lambda conn: work(_on_held(conn)), "database")
        async with self.writing() as conn:
            return await conn.run_sync(lambda sync: work(_on_sqlalchemy(sync)))

    async def _claim_many_sqlite(
        self, requests: Sequence[ClaimRequest], now: datetime, lease: timedelta
    ) -> list[tuple[Claim, JobRecord, JobState] | None]:
        """The batch's claims in one transaction of three statements: the states the jobs
        leave, ONE guarded ``UPDATE … FROM json_each(…) RETURNING`` (each row's owner its
        request's worker) and their ``claimed`` events in one insert.

        The guard is ``claimable`` per row, as ``claim_delivered``'s; under ``BEGIN
        IMMEDIATE`` nothing else writes between the read and the update."""
        clock = self.local_now()
        params = {
            "reqs": fastjson.dumps([[r.job_id, r.job_type, r.worker_id] for r in requests]),
            "updated_at": now,
            "lease_ends": clock + lease,
            "now": clock,
            "due_by": clock + RETRY_SLACK,
        }
        left, won = await self._sqlite_tx(lambda run: _claim_tx(run, requests, params, now))
        results: list[tuple[Claim, JobRecord, JobState] | None] = []
        for request in requests:
            row = won.get(request.job_id)
            if row is None:
                results.append(None)
                continue
            job = job_record(row)
            claim = Claim(job.id, job.attempt, request.worker_id)
            results.append((claim, job, JobState(left[request.job_id])))
        return results

    async def _complete_many_sqlite(
        self, requests: Sequence[CompleteRequest], now: datetime
    ) -> set[str]:
        """The batch's completions in one transaction of two statements: ONE update fenced
        per row (``fenced`` of each claim; each row's key and meta its own), ``RETURNING``
        the jobs whose completion won, and their ``result_saved`` events in one insert.

        Every row is checked (``outcome_json``, ``_bindable``) before the transaction
        begins; one that cannot be stored fails the batch with a ``StoreDataError``, and the
        batcher then sends each request alone, so only that job fails."""
        reqs = fastjson.dumps(
            [
                [
                    r.claim.job_id,
                    r.claim.attempt,
                    r.claim.worker_id,
                    _bindable(r.result_key),
                    outcome_json(r.result_key, r.result_meta),
                ]
                for r in requests
            ]
        )
        return await self._sqlite_tx(lambda run: _complete_tx(run, requests, reqs, now))


def jsonable_rows(rows: list[list[Any]]) -> list[list[Any]]:
    """Each (job id, detail) with its detail's datetimes as ISO text, as the JSON column
    writes them."""
    return [[job_id, jsonable(detail)] for job_id, detail in rows]


__all__ = ["ClaimRequest", "CompleteRequest", "SqliteBatches"]
