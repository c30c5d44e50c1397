"""What every store module shares: the engine, the ONE clock, transactions, and the SQL
that more than one concept writes (an event, an outbox message, a guarded transition).

The rules every store method keeps:
- A state change is a guarded ``UPDATE … WHERE state IN (:legal sources)``; the caller learns
  from the result whether it won. Nobody overwrites a state they did not read.
- Each transition writes its ``job_events`` row in the same transaction.
- A message to send is an ``outbox`` row written in the same transaction as the state it
  belongs to; nothing here talks to the broker.
- Every write after a claim is fenced on the claim token: the job id, ``running`` and the
  attempt number the claim produced (each claim increments it, so it names one claim). A
  write that loses changes nothing and the caller records ``lease_lost``.
- What is *judged* by time (is a lease live, is a retry due, when does a new lease end) uses
  ONE clock, the store's: on PostgreSQL the database's own ``now()`` in SQL, on SQLite this
  process's clock (one process owns the file). No worker host's clock decides. Times that
  are only *recorded* (an event's ``at``) still come from the caller. Tests inject a clock
  into the store to move time.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, Select, delete, func, insert, select, text, update
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from jobrelay.domain.messages import JobMessage
from jobrelay.domain.states import JobState, sources_for
from jobrelay.observe import tracing
from jobrelay.observe.tracing import trace_headers
from jobrelay.storage.delayed import due_since
from jobrelay.storage.dependencies import finish_steps
from jobrelay.storage.drivers import open_driver
from jobrelay.storage.effects import EffectsLedger
from jobrelay.storage.engine import read_tx, write_tx
from jobrelay.storage.installation import IdKeyCache, Installation
from jobrelay.storage.records import (
    Clock,
    jsonable,
    retry_destination,
    utc_now,
    work_destination,
)
from jobrelay.storage.steps import run_async
from jobrelay.storage.tables import job_events, job_slots, jobs, outbox
from jobrelay.storage.transitions import Inputs, Transition, awaiting_admission, state_in, values_of


def first_message_headers(job_id: str) -> Select[tuple[Any]]:
    """The headers of the job's oldest outbox row retention kept: where a job written before
    migration 0020 keeps its trace context."""
    return select(outbox.c.headers).where(outbox.c.job_id == job_id).order_by(outbox.c.id).limit(1)


class StoreBase:
    def __init__(
        self, engine: AsyncEngine, *, clock: Clock | None = None, id_secret: bytes | None = None
    ) -> None:
        self.engine = engine
        # What differs between the databases, in one object (``storage.drivers``).
        self.driver = open_driver(engine, clock)
        # What callers above storage may ask of this database, instead of its name.
        self.capabilities = self.driver.capabilities
        # None: the database's clock on PostgreSQL, this process's on SQLite. Tests inject one.
        self._clock = clock
        # The secret job ids are keyed with: the installation's row, read once and kept
        # (``id_secret``, JOBRELAY_ID_SECRET, replaces it). A test's clock also ages the copy.
        monotonic = time.monotonic if clock is None else (lambda: clock().timestamp())
        self.installation = Installation(engine, IdKeyCache(id_secret, monotonic=monotonic))
        # In-process wake-ups for a relay in this same process (``jobrelay up``), set after
        # a commit that wrote outbox rows. PostgreSQL relays elsewhere get NOTIFY instead.
        self.outbox_listeners: list[asyncio.Event] = []
        # External effects of jobs (e-mails sent): a small module of its own, same database.
        self.effects = EffectsLedger(engine)

    @property
    def renewal_blocks_takeover(self) -> bool:
        """Whether a lease renewal that waits also holds off every takeover of its claims
        (the driver's answer: SQLite's one write lock does; PostgreSQL's ``SKIP LOCKED``
        renewal waits on no row, so no answer in time means the database is away)."""
        return self.driver.renewal_blocks_takeover

    def hot_connections(self) -> contextlib.AbstractAsyncContextManager[None]:
        """Held by a worker or relay while it runs: the connections its hot statements use
        (asyncpg connections on PostgreSQL, one ``sqlite3`` connection on SQLite)."""
        return self.driver.hot_connections()

    def intake_connections(self) -> contextlib.AbstractAsyncContextManager[None]:
        """Held by the API while it serves: its accepts' connections (``Driver.write_new_job``)."""
        return self.driver.intake_connections()

    def wake_relays(self) -> None:
        for listener in self.outbox_listeners:
            listener.set()

    def now_sql(self, plus: timedelta = timedelta(0)) -> ColumnElement[datetime]:
        """The store's clock (+ ``plus``) as a SQL expression, for guards and lease ends:
        the database's ``now()`` on PostgreSQL, this process's clock on SQLite."""
        return self.driver.now_sql(plus)

    def local_now(self) -> datetime:
        return self._clock() if self._clock is not None else utc_now()

    async def db_now(self) -> datetime:
        """The store's clock as a value (one round trip on PostgreSQL, none on SQLite)."""
        return await self.driver.db_now()

    def writing(self) -> contextlib.AbstractAsyncContextManager[AsyncConnection]:
        return write_tx(self.engine, "database")

    def reading(self) -> contextlib.AbstractAsyncContextManager[AsyncConnection]:
        return read_tx(self.engine, "database")

    def upsert(self, table: Any) -> Any:
        return self.driver.upsert(table)

    def minute_of(self, column: Any) -> ColumnElement[Any]:
        return self.driver.minute_of(column)

    async def add_event(
        self, conn: AsyncConnection, job_id: str, kind: str, now: datetime, **detail: Any
    ) -> None:
        await conn.execute(
            insert(job_events).values(job_id=job_id, at=now, kind=kind, detail=jsonable(detail))
        )
        # Also an event of the span this process has open for the job, if any (its run's).
        tracing.event(kind, now, detail)

    async def add_events(
        self, conn: AsyncConnection, kind: str, now: datetime, details: Mapping[str, Any]
    ) -> None:
        """One ``kind`` event for each job of ``details`` (job id -> detail), in one
        statement whatever their number (an admission round holds back a backlog at once)."""
        if details:
            await conn.execute(
                insert(job_events),
                [
                    {"job_id": job_id, "at": now, "kind": kind, "detail": jsonable(detail)}
                    for job_id, detail in details.items()
                ],
            )

    async def next_message(
        self,
        conn: AsyncConnection,
        job_id: str,
        message: str | bytes,
        queue: str,
        now: datetime,
        *,
        delay: int | None = None,
        headers: Mapping[str, str] | None = None,
        extra_headers: Mapping[str, str] | None = None,
        available_at: datetime | None = None,
    ) -> None:
        """The job's next message, an outbox row in the caller's transaction: its work queue,
        or with ``delay`` the delay route back to it (a retry, a deferral). ``message`` is the
        job's type (its message is written from it) or a raw body passed on unchanged (a
        delivery only newer workers can read). Without ``headers`` it carries the trace the
        job was enqueued under (``jobs.trace_context``). ``available_at``: held until then
        (``storage.delayed``). A job under limits that holds no admission (a retry, a replay,
        a takeover: the transition before this gave its slots back) has its row wait for the
        next one."""
        destination = work_destination(queue) if delay is None else retry_destination(delay, queue)
        body = message if isinstance(message, bytes) else JobMessage(job_id, message).encode()
        if headers is None:
            # Retries, deferrals and repairs carry on the trace of the job's enqueue.
            headers = await conn.scalar(select(jobs.c.trace_context).where(jobs.c.id == job_id))
            if headers is None:
                # A job written by a version before 0020 (a rolling upgrade): its messages
                # carry it.
                headers = trace_headers(await conn.scalar(first_message_headers(job_id))) or None
        await conn.execute(
            insert(outbox).values(
                job_id=job_id,
                destination=destination,
                body=body.decode(),
                headers={**(headers or {}), **(extra_headers or {})},
                created_at=now,
                **({"available_at": available_at} if available_at is not None else {}),
                awaiting_admission=select(awaiting_admission())
                .where(jobs.c.id == job_id)
                .scalar_subquery(),
            )
        )
        await self.driver.notify_outbox(conn)

    state_in = staticmethod(state_in)

    async def release_slots(self, conn: AsyncConnection, declared: Transition, job_id: str) -> bool:
        """The slots ``job_id``'s admission took, given back in the transaction of a
        transition that ends its run (``declared.releases``); True when it held any. The
        relays elsewhere are told at the commit (``notify_outbox``); the caller wakes this
        process's after it (``wake_relays``): the key's next job is admitted now. Every
        transition that ends a job passes here, so it also tells the job's waiters
        (``notify_done``) and settles the jobs that run after it (``storage.dependencies``;
        True too when one of those is queued: its message waits for the relays)."""
        settled = False
        if declared.target is not None and declared.target.is_terminal:
            await self.driver.notify_done(conn)  # the job ended: its waiters, at the commit
            ended = {job_id: declared.target.value}
            settled = bool(
                await run_async(
                    conn, finish_steps(self.capabilities.listens, ended, self.local_now())
                )
            )
        if not declared.releases:
            return settled
        result = await conn.execute(delete(job_slots).where(job_slots.c.job_id == job_id))
        if not result.rowcount:
            return settled
        await self.driver.notify_outbox(conn)
        return True

    async def transition(
        self,
        conn: AsyncConnection,
        job_id: str,
        declared: Transition,
        now: datetime,
        *,
        sources: Iterable[JobState] | None = None,
        where: Sequence[Any] = (),
        **values: Any,
    ) -> bool:
        """``declared`` (``transitions``) on one job, guarded on the legal sources of its
        target (or ``sources``) and ``where``; ``values`` are the request's (``Inputs.req``).
        True when it won."""
        assert declared.target is not None
        allowed = sources if sources is not None else sources_for(declared.target)
        i = Inputs(now=now, clock=self.now_sql(), req=values_of(values))
        result = await conn.execute(
            update(jobs)
            .where(jobs.c.id == job_id, state_in(allowed), *declared.guards(i), *where)
            .values(**declared.sets(i))
        )
        if result.rowcount != 1:
            return False
        await self.release_slots(conn, declared, job_id)
        return True

    def job_query(self) -> Any:
        waiting = (
            select(
                # Since it was due: a delayed job's row counts from its run time.
                func.min(due_since()).label("unpublished_since"),
            )
            .where(outbox.c.job_id == jobs.c.id, outbox.c.published_at.is_(None))
            .scalar_subquery()
        )
        any_published = (
            select(func.count())
            .where(outbox.c.job_id == jobs.c.id, outbox.c.published_at.is_not(None))
            .scalar_subquery()
        )
        last_error = (
            select(outbox.c.last_error)
            .where(outbox.c.job_id == jobs.c.id, outbox.c.published_at.is_(None))
            .order_by(outbox.c.id.desc())
            .limit(1)
            .scalar_subquery()
        )
        return select(
            jobs,
            waiting.label("unpublished_since"),
            any_published.label("published_count"),
            last_error.label("last_publish_error"),
            self.now_sql().label("observed_at"),
        )

    async def cut_sessions(self) -> None:
        await self.driver.cut_sessions()

    async def ping(self) -> None:
        async with self.reading() as conn:
            await conn.execute(text("SELECT 1"))
