"""The PostgreSQL driver: the transitions' statements (``pg_statements``) on the asyncpg
connections a worker or relay holds (``pg_pool``), else through SQLAlchemy; the database's
own ``now()`` as the store's clock; ``NOTIFY`` to wake relays.

One statement per transition serves one job and a batch alike (arrays, ``unnest``): a single
job is a batch of one. A completion with a step of its own (publish a staged result, create
follow-ups) runs the same statement in a write transaction with those steps before the commit.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, Executable, func, literal, select, text, type_coerce
from sqlalchemy.dialects import postgresql
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from jobrelay import fastjson
from jobrelay.domain.policy import RETRY_SLACK
from jobrelay.storage.capabilities import POSTGRESQL
from jobrelay.storage.drivers import pg_statements as sql
from jobrelay.storage.drivers.compiled import CompiledStatement
from jobrelay.storage.drivers.new_job import new_job_steps
from jobrelay.storage.drivers.pg_pool import HotPool, HotResult, pg_statement
from jobrelay.storage.engine import read_tx, statement_tx
from jobrelay.storage.records import (
    DONE_CHANNEL,
    NOTIFY_CHANNEL,
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
)
from jobrelay.storage.steps import run_async, run_on
from jobrelay.storage.storable import outcome_json
from jobrelay.storage.tables import UTCDateTime
from jobrelay.storage.transitions import claimed_detail, result_saved_detail

# The advisory lock key admissions are serialised by (``serialize_admission``); the
# leader's session lock uses another (``maintenance.leadership``).
ADMISSION_LOCK = 0x6A72_6C6D  # "jrlm"
# The API's intake connections: as many as its SQLAlchemy pool may open, one at start (the
# rest as the accepts come: a test suite runs many APIs on one server). An accept through
# SQLAlchemy paid ``engine.connect``, its pool and a greenlet per statement: the API's CPU
# per accept was 1,190 µs through it, 753-780 µs on the intake (accept bench, issue 41).
INTAKE_POOL_SIZE = 20
# The new job's statements (a few, each built once: ``pg_new_job``) compiled once each. Keyed
# by the statement object (hashed and compared by identity), which the cache keeps alive.
_compiled = functools.lru_cache(maxsize=64)(pg_statement)


# A hot statement in the caller's transaction (a turn whose completions publish a staged
# result, say) planned as on the held connections: generically. Left to itself PostgreSQL
# planned each one afresh (its array of ids known, it judged the custom plan cheaper): about
# a millisecond of planning a statement, measured with auto_explain (every TURN of the export
# drain custom-planned). This transaction only (its steps after the statement too: a
# follow-up's insert, the dependants' edges, each a lookup by key); one round trip.
_GENERIC_PLANS = text("SET LOCAL plan_cache_mode = force_generic_plan")


async def _notify(conn: AsyncConnection, channel: str) -> None:
    # Delivered at commit, to listeners only: a hint, never the only path.
    await conn.execute(text("SELECT pg_notify(:c, '')"), {"c": channel})


class PostgresDriver:
    capabilities = POSTGRESQL

    def __init__(self, engine: AsyncEngine, clock: Clock | None) -> None:
        self.engine = engine
        # None: the database's clock. Tests inject one, bound as ``clock.now``.
        self._clock = clock
        self.hot = HotPool(engine.url)
        self.intake = HotPool(engine.url, INTAKE_POOL_SIZE, eager=1)

    @property
    def renewal_blocks_takeover(self) -> bool:
        # The renewal waits on no row (``SKIP LOCKED``): no answer in time means the
        # database cannot be reached.
        return False

    def hot_connections(self) -> contextlib.AbstractAsyncContextManager[None]:
        return self.hot.held()

    def intake_connections(self) -> contextlib.AbstractAsyncContextManager[None]:
        return self.intake.held()

    async def write_new_job(self, job: NewJob, now: datetime) -> tuple[str, bool]:
        steps = new_job_steps("postgresql", job, now)
        if not self.intake.active:
            async with statement_tx(self.engine, "database") as conn:
                return await run_async(conn, steps)
        return await run_on(self._on_intake, steps)

    async def _on_intake(self, statement: Executable, params: Mapping[str, Any] | None) -> Any:
        return HotResult(await self.intake.fetch(_compiled(statement), params or {}))

    def now_sql(self, plus: timedelta = timedelta(0)) -> ColumnElement[datetime]:
        if self._clock is None:
            expr = func.now() if not plus else func.now() + plus
            return type_coerce(expr, UTCDateTime())
        return literal(self._clock() + plus, UTCDateTime())

    async def db_now(self) -> datetime:
        if self._clock is not None:
            return self._clock()
        async with read_tx(self.engine, "database") as conn:
            value = await conn.scalar(select(self.now_sql()))
        assert isinstance(value, datetime)
        return value

    def upsert(self, table: Any) -> Any:
        return postgresql.insert(table)

    def minute_of(self, column: Any) -> ColumnElement[Any]:
        return func.date_trunc("minute", column)

    async def serialize_admission(self, conn: AsyncConnection) -> None:
        # A transaction-scoped advisory lock: released at its commit or rollback.
        await conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": ADMISSION_LOCK})

    async def notify_outbox(self, conn: AsyncConnection) -> None:
        await _notify(conn, NOTIFY_CHANNEL)

    async def notify_done(self, conn: AsyncConnection) -> None:
        await _notify(conn, DONE_CHANNEL)

    async def cut_sessions(self) -> None:
        async with statement_tx(self.engine, "database") as conn:
            await conn.execute(
                text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                    " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                )
            )

    async def rows(
        self,
        statement: CompiledStatement,
        params: Mapping[str, Any],
        conn: AsyncConnection | None = None,
    ) -> Sequence[Any]:
        """One statement; its rows, each read by column name. In ``conn``'s transaction when
        given; else in autocommit, on the held connections while a role holds them."""
        if conn is None and self.hot.active:
            return await self.hot.fetch(statement, params)
        if conn is not None:
            await conn.execute(_GENERIC_PLANS)
            result = await conn.execute(statement.statement, params)
            return list(result.mappings()) if result.returns_rows else []
        async with statement_tx(self.engine, "database") as own:
            result = await own.execute(statement.statement, params)
            return list(result.mappings()) if result.returns_rows else []

    def _clock_param(self) -> datetime | None:
        return self._clock() if self._clock is not None else None

    async def claim_many(
        self,
        requests: Sequence[ClaimRequest],
        now: datetime,
        lease: timedelta,
        events: Sequence[PendingEvent] = (),
    ) -> list[Claimed]:
        rows = await self.rows(sql.CLAIM_MANY, self._claim_params(requests, now, lease, events))
        return _claimed(requests, rows)

    async def complete_many(
        self,
        requests: Sequence[CompleteRequest],
        now: datetime,
        conn: AsyncConnection | None = None,
    ) -> Won:
        # In the caller's transaction, which settles the jobs waiting for these.
        params = {**_complete_params(requests, settles=conn is not None), "b_now": now}
        rows = await self.rows(sql.COMPLETE_MANY, params, conn)
        return _won((row["id"], row["has_dependants"], row) for row in rows)

    async def turn(
        self,
        claims: Sequence[ClaimRequest],
        completions: Sequence[CompleteRequest],
        now: datetime,
        lease: timedelta,
        events: Sequence[PendingEvent] = (),
        conn: AsyncConnection | None = None,
    ) -> tuple[list[Claimed], Won]:
        params = {
            **self._claim_params(claims, now, lease, events),
            **_complete_params(completions, settles=conn is not None),
        }
        rows = await self.rows(sql.TURN, params, conn)
        won = _claimed(claims, [row for row in rows if row["done_id"] is None])
        return won, _won(
            (row["done_id"], row["done_has_dependants"], row)
            for row in rows
            if row["done_id"] is not None
        )

    def _claim_params(
        self,
        requests: Sequence[ClaimRequest],
        now: datetime,
        lease: timedelta,
        events: Sequence[PendingEvent],
    ) -> dict[str, Any]:
        return {
            **_event_params(events),
            "b_ids": [r.job_id for r in requests],
            "b_types": [r.job_type for r in requests],
            "b_workers": [r.worker_id for r in requests],
            "b_details": [fastjson.dumps(claimed_detail(r.worker_id, r.detail)) for r in requests],
            "b_seen_states": [r.seen_state for r in requests],
            "b_seen_attempts": [r.seen_attempt for r in requests],
            "b_alone": [int(r.alone) for r in requests],
            "b_now": now,
            "b_lease": lease,
            "b_slack": RETRY_SLACK,
            "b_clock": self._clock_param(),
        }

    async def renew_many(self, claims: Sequence[Claim], lease: timedelta, now: datetime) -> Renewed:
        params = {
            "b_ids": [c.job_id for c in claims],
            "b_attempts": [c.attempt for c in claims],
            "b_workers": [c.worker_id for c in claims],
            "b_lease": lease,
            "b_now": now,
            "b_clock": self._clock_param(),
        }
        rows = await self.rows(sql.RENEW_MANY, params)
        # By job and attempt: one worker may send a stale claim of a job beside its current
        # one (a redelivery it claimed again after the first lease ran out).
        won = {
            (row["id"], row["attempt"]): bool(row["cancel_requested"])
            for row in rows
            if not row["skipped"]
        }
        skipped = {(row["id"], row["attempt"]) for row in rows if row["skipped"]}
        return Renewed(
            (c for c in claims if (c.job_id, c.attempt) in won),
            (c for c in claims if won.get((c.job_id, c.attempt))),
            (c for c in claims if (c.job_id, c.attempt) in skipped),
        )

    async def record_events(self, events: Sequence[PendingEvent]) -> None:
        await self.rows(sql.RECORD_MANY, _event_params(events))

    async def claim_outbox(
        self, relay_id: str, limit: int, claim_for: timedelta
    ) -> list[OutboxRow]:
        params = {
            "o_relay": relay_id,
            "o_limit": limit,
            "o_claim_for": claim_for,
            "o_clock": self._clock_param(),
        }
        claimed = sorted(await self.rows(sql.CLAIM_OUTBOX, params), key=lambda r: r["id"])
        return [outbox_row(r, r["publish_attempts"]) for r in claimed]

    async def mark_published(self, relay_id: str, rows: Sequence[OutboxRow]) -> int:
        params = {
            "m_ids": [r.id for r in rows],
            "m_taken": [r.taken_at for r in rows],
            "m_relay": relay_id,
            "m_clock": self._clock_param(),
        }
        [marked] = await self.rows(sql.MARK_PUBLISHED, params)
        return int(marked["marked"])


__all__ = ["PostgresDriver"]


def _claimed(requests: Sequence[ClaimRequest], rows: Sequence[Any]) -> list[Claimed]:
    won = {row["id"]: row for row in rows}
    left = {job_id: row["claimed_from_state"] for job_id, row in won.items()}
    return claimed_in_order(requests, won, left)


def _complete_params(requests: Sequence[CompleteRequest], *, settles: bool) -> dict[str, Any]:
    return {
        "d_ids": [r.claim.job_id for r in requests],
        "d_attempts": [r.claim.attempt for r in requests],
        "d_workers": [r.claim.worker_id for r in requests],
        "d_keys": [r.result_key for r in requests],
        "d_metas": [outcome_json(r.result_key, r.result_meta) for r in requests],
        "d_values": [r.result_value for r in requests],
        "d_details": [
            fastjson.dumps(result_saved_detail(r.claim, r.result_key, r.result_meta))
            for r in requests
        ],
        "d_dones": [r.progress[0] if r.progress else None for r in requests],
        "d_totals": [r.progress[1] if r.progress else None for r in requests],
        "d_settles": settles,
    }


def _won(rows: Iterable[tuple[str, bool, Any]]) -> Won:
    """The completions' answer: (job id, whether others wait for it, its row)."""
    done: list[tuple[str, bool, Any]] = []
    deferred: list[str] = []
    for job_id, has_dependants, row in rows:
        if row["deferred"]:
            deferred.append(job_id)
        else:
            done.append((job_id, has_dependants, row))
    return Won(
        (job_id for job_id, _, _ in done),
        any(row["wakes"] for _, _, row in done),
        dependants=(job_id for job_id, dependants, _ in done if dependants),
        deferred=deferred,
    )


def _event_params(events: Sequence[PendingEvent]) -> dict[str, list[Any]]:
    return {
        "e_jobs": [e.job_id for e in events],
        "e_ats": [e.at for e in events],
        "e_kinds": [e.kind for e in events],
        "e_details": [fastjson.dumps(jsonable(e.detail)) for e in events],
    }
