"""The SQLite driver: the transitions' statements (``sqlite_statements``) in ONE write
transaction per batch, on the ``sqlite3`` connection a worker holds (``sqlite_conn``: the
whole transaction in one hand-off to its thread), else through SQLAlchemy; this process's
clock as the store's (one process owns the file); no wake-up beyond the process.

There is no network to save round trips on: what costs is the commit (the write lock taken
and given back; at ``synchronous=NORMAL`` in WAL no fsync per commit) and the Python per
statement. So a batch of claims is three statements (the states left, the claims, their
events), a batch of completions two. A single job is a batch of one.

A row that cannot be stored fails the transaction, all of it rolled back, with a
``StoreDataError``: the worker's batcher then sends each request alone, so only that job
fails. Nothing of a batch is acked before it has committed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any, TypeVar

from sqlalchemy import ColumnElement, func, insert, literal, or_, select, update
from sqlalchemy.dialects import sqlite
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from jobrelay import fastjson
from jobrelay.domain.policy import RETRY_SLACK
from jobrelay.errors import StoreDataError
from jobrelay.storage.capabilities import SQLITE
from jobrelay.storage.delayed import outbox_due
from jobrelay.storage.drivers import sqlite_statements as sql
from jobrelay.storage.drivers.new_job import new_job_steps
from jobrelay.storage.drivers.sqlite_conn import Execute, SqliteHot, in_transaction, on_sqlalchemy
from jobrelay.storage.engine import statement_tx, write_tx
from jobrelay.storage.records import (
    Claim,
    Claimed,
    ClaimRequest,
    Clock,
    CompleteRequest,
    NewJob,
    OutboxRow,
    PendingEvent,
    Renewed,
    Won,
    claimed_in_order,
    jsonable,
    outbox_row,
    utc_now,
)
from jobrelay.storage.steps import run_async
from jobrelay.storage.storable import outcome_json, safe_text
from jobrelay.storage.tables import UTCDateTime, job_events, outbox
from jobrelay.storage.transitions import claimed_detail, outbox_admissible, result_saved_detail

T = TypeVar("T")


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


def _events(execute: Execute, kind: str, at: datetime, rows: list[list[Any]]) -> None:
    """(job id, detail) pairs as ``kind`` events, in one insert."""
    if rows:
        execute(sql.EVENTS_RUN, {"reqs": fastjson.dumps(rows), "at": at, "kind": kind})


def _record(execute: Execute, events: Sequence[PendingEvent]) -> None:
    """State-less events, one insert per kind and time."""
    by_kind: dict[tuple[str, datetime], list[list[Any]]] = {}
    for e in events:
        by_kind.setdefault((e.kind, e.at), []).append([e.job_id, jsonable(e.detail)])
    for (kind, at), rows in by_kind.items():
        _events(execute, kind, at, rows)


# A claim's answer as read: the states the jobs left, and the rows it claimed.
_ClaimRows = tuple[dict[str, str], dict[str, Mapping[str, Any]]]


def _claim_tx(
    execute: Execute, requests: Sequence[ClaimRequest], params: dict[str, Any], now: datetime
) -> _ClaimRows:
    asked = {r.job_id: r for r in requests}
    left = {row["id"]: row["state"] for row in execute(sql.STATES_RUN, params)}
    won = {row["id"]: row for row in execute(sql.CLAIM_RUN, params)}
    events = [
        [
            job_id,
            {
                **claimed_detail(asked[job_id].worker_id, asked[job_id].detail),
                "attempt": row["attempt"],
            },
        ]
        for job_id, row in won.items()
    ]
    _events(execute, "claimed", now, events)
    return left, won


def _complete_work(
    requests: Sequence[CompleteRequest], now: datetime, settles: bool
) -> Callable[[Execute], Won]:
    """The completions' transaction work, every row checked (``outcome_json``,
    ``_bindable``) before any transaction begins."""
    reqs = fastjson.dumps(
        [
            [
                r.claim.job_id,
                r.claim.attempt,
                r.claim.worker_id,
                _bindable(r.result_key),
                outcome_json(r.result_key, r.result_meta),
                r.result_value,
                *(r.progress or (None, None)),
            ]
            for r in requests
        ]
    )
    return lambda run: _complete_tx(run, requests, reqs, now, settles)


def _complete_tx(
    execute: Execute,
    requests: Sequence[CompleteRequest],
    reqs: str,
    now: datetime,
    settles: bool,
) -> Won:
    rows = execute(sql.COMPLETE_RUN, {"reqs": reqs, "updated_at": now, "settles": settles})
    ids = {row["id"] for row in rows}
    deferred: list[str] = []
    lost = sorted({r.claim.job_id for r in requests} - ids)
    if lost and not settles:
        # Rare (a stale claim, or a job others wait for): which were left to a transaction
        # that settles the jobs waiting for them.
        deferred = [row["id"] for row in execute(sql.DEFERRED_RUN, {"ids": fastjson.dumps(lost)})]
    # Only a job under limits holds slots (its turn key is set at enqueue): a batch with
    # none of them sends no release.
    limited = sorted(row["id"] for row in rows if row["turn_key"] is not None)
    wakes = False
    if limited:
        execute(sql.RELEASE_RUN, {"ids": fastjson.dumps(limited)})
        wakes = bool(execute(sql.HELD_RUN, {}))
    events = [
        [r.claim.job_id, result_saved_detail(r.claim, r.result_key, r.result_meta)]
        for r in requests
        if r.claim.job_id in ids
    ]
    _events(execute, "result_saved", now, events)
    return Won(ids, wakes, (row["id"] for row in rows if row["has_dependants"]), deferred)


class SqliteDriver:
    capabilities = SQLITE

    def __init__(self, engine: AsyncEngine, clock: Clock | None) -> None:
        self.engine = engine
        self._clock = clock
        self.hot = SqliteHot(engine)

    @property
    def renewal_blocks_takeover(self) -> bool:
        # A renewal waits only for the one write lock, and a takeover (a claim) needs that
        # lock too: however long the wait, the renewer awaits the database's answer.
        return True

    def hot_connections(self) -> contextlib.AbstractAsyncContextManager[None]:
        return self.hot.held()

    def intake_connections(self) -> contextlib.AbstractAsyncContextManager[None]:
        # One writer at a time whatever the connection: the engine's serve the API.
        return contextlib.nullcontext()

    async def write_new_job(self, job: NewJob, now: datetime) -> tuple[str, bool]:
        async with statement_tx(self.engine, "database") as conn:
            return await run_async(conn, new_job_steps("sqlite", job, now))

    def local_now(self) -> datetime:
        return self._clock() if self._clock is not None else utc_now()

    def now_sql(self, plus: timedelta = timedelta(0)) -> ColumnElement[datetime]:
        # Computed here: SQLite has no interval arithmetic on the text it stores times as.
        return literal(self.local_now() + plus, UTCDateTime())

    async def db_now(self) -> datetime:
        return self.local_now()

    def upsert(self, table: Any) -> Any:
        return sqlite.insert(table)

    def minute_of(self, column: Any) -> ColumnElement[Any]:
        # UTCDateTime stores naive UTC text on SQLite.
        return func.strftime("%Y-%m-%d %H:%M:00", column)

    async def serialize_admission(self, conn: AsyncConnection) -> None:
        return None  # a write transaction on SQLite is already the only one

    async def notify_outbox(self, conn: AsyncConnection) -> None:
        return None  # nothing listens beyond the process (``capabilities.listens``)

    async def notify_done(self, conn: AsyncConnection) -> None:
        return None  # waiters watch the file's ``data_version`` (``library.waiting``)

    async def cut_sessions(self) -> None:
        return None  # no server, no sessions to cut

    async def _tx(self, work: Callable[[Execute], T], conn: AsyncConnection | None = None) -> T:
        """``work`` in one write transaction: ``conn``'s when given; else on the held
        connection in one hand-off to its thread while a worker runs, else SQLAlchemy's."""
        if conn is not None:
            return await conn.run_sync(lambda sync: work(on_sqlalchemy(sync)))
        return await in_transaction(self.engine, self.hot, work, "database")

    async def claim_many(
        self,
        requests: Sequence[ClaimRequest],
        now: datetime,
        lease: timedelta,
        events: Sequence[PendingEvent] = (),
    ) -> list[Claimed]:
        """The batch's claims in one transaction: the states the jobs leave, ONE guarded
        ``UPDATE … FROM json_each(…) RETURNING`` (each row's owner its request's worker) and
        their ``claimed`` events in one insert. Under ``BEGIN IMMEDIATE`` nothing else writes
        between the read and the update."""
        left, won = await self._tx(self._claim_work(requests, now, lease, events))
        return claimed_in_order(requests, won, left)

    async def complete_many(
        self,
        requests: Sequence[CompleteRequest],
        now: datetime,
        conn: AsyncConnection | None = None,
    ) -> Won:
        """ONE update fenced per row, ``RETURNING`` the jobs whose completion won, and their
        ``result_saved`` events in one insert. Every row is checked (``outcome_json``,
        ``_bindable``) before the transaction begins."""
        settles = conn is not None  # the caller's transaction settles the jobs waiting
        return await self._tx(_complete_work(requests, now, settles), conn)

    async def turn(
        self,
        claims: Sequence[ClaimRequest],
        completions: Sequence[CompleteRequest],
        now: datetime,
        lease: timedelta,
        events: Sequence[PendingEvent] = (),
        conn: AsyncConnection | None = None,
    ) -> tuple[list[Claimed], Won]:
        """Both in one transaction, so one commit: on SQLite the commit is the cost."""
        complete = _complete_work(completions, now, conn is not None)
        claim = self._claim_work(claims, now, lease, events)

        def work(run: Execute) -> tuple[_ClaimRows, Won]:
            won = complete(run)
            return claim(run), won

        (left, claimed), won = await self._tx(work, conn)
        return claimed_in_order(claims, claimed, left), won

    def _claim_work(
        self,
        requests: Sequence[ClaimRequest],
        now: datetime,
        lease: timedelta,
        events: Sequence[PendingEvent],
    ) -> Callable[[Execute], _ClaimRows]:
        clock = self.local_now()
        rows = [
            [r.job_id, r.job_type, r.worker_id, r.seen_state, r.seen_attempt, int(r.alone)]
            for r in requests
        ]
        params = {
            "reqs": fastjson.dumps(rows),
            "updated_at": now,
            "lease_ends": clock + lease,
            "now": clock,
            "due_by": clock + RETRY_SLACK,
        }

        def work(run: Execute) -> _ClaimRows:
            _record(run, events)  # the commit they ride on is the claim's
            return _claim_tx(run, requests, params, now)

        return work

    async def renew_many(self, claims: Sequence[Claim], lease: timedelta, now: datetime) -> Renewed:
        reqs = fastjson.dumps([[c.job_id, c.attempt, c.worker_id] for c in claims])
        params = {"reqs": reqs, "updated_at": now, "lease_ends": self.local_now() + lease}
        rows = await self._tx(lambda run: run(sql.RENEW_RUN, params))
        # The column itself, not ``… IS NOT NULL`` in RETURNING: this SQLite evaluates an
        # expression there over the FROM's row, not the updated one (measured: always 1).
        won = {
            (row["id"], int(row["attempt"])): row["cancel_requested_at"] is not None for row in rows
        }
        return Renewed(
            (c for c in claims if (c.job_id, c.attempt) in won),
            (c for c in claims if won.get((c.job_id, c.attempt))),
        )

    async def record_events(self, events: Sequence[PendingEvent]) -> None:
        await self._tx(lambda run: _record(run, events))

    async def claim_outbox(
        self, relay_id: str, limit: int, claim_for: timedelta
    ) -> list[OutboxRow]:
        now = self.now_sql()
        async with write_tx(self.engine, "database") as conn:
            rows = (
                await conn.execute(
                    select(outbox, now.label("taken_at"))
                    .where(
                        outbox.c.published_at.is_(None),
                        or_(outbox.c.claimed_until.is_(None), outbox.c.claimed_until < now),
                        outbox_due(now),
                        outbox_admissible(),
                    )
                    .order_by(outbox.c.id)
                    .limit(limit)
                )
            ).all()
            if not rows:
                return []
            await conn.execute(
                update(outbox)
                .where(outbox.c.id.in_([r.id for r in rows]))
                .values(
                    claimed_by=relay_id,
                    claimed_until=self.now_sql(claim_for),
                    publish_attempts=outbox.c.publish_attempts + 1,
                )
            )
        return [outbox_row(r._mapping, r.publish_attempts + 1) for r in rows]

    async def mark_published(self, relay_id: str, rows: Sequence[OutboxRow]) -> int:
        taken = {r.id: r.taken_at for r in rows}
        async with write_tx(self.engine, "database") as conn:
            done = await conn.execute(
                update(outbox)
                .where(outbox.c.id.in_([r.id for r in rows]), outbox.c.published_at.is_(None))
                .values(published_at=self.now_sql(), claimed_until=None, last_error=None)
                .returning(outbox.c.id, outbox.c.job_id, outbox.c.destination)
            )
            marked = done.all()
            if marked:
                await conn.execute(
                    insert(job_events),
                    [
                        {
                            "job_id": m.job_id,
                            "at": taken[m.id],
                            "kind": "published",
                            "detail": {
                                "destination": m.destination,
                                "outboxId": m.id,
                                "relay": relay_id,
                            },
                        }
                        for m in marked
                    ],
                )
        return len(marked)


__all__ = ["SqliteDriver"]
