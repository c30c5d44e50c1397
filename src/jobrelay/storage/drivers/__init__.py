"""One driver per database: what differs between PostgreSQL and SQLite, and nothing else.

The store (``storage.store``) is written once over this port: the portable queries in
SQLAlchemy Core, the hot transitions (``transitions``) through ``Driver``, whose two
implementations compile the same declarations into their own statements and run them on the
connections they hold. ``open_driver`` is the one place that picks one by the engine's
database; a new backend is a module here implementing ``Driver`` and a line in it (compare
River's ``riverdriver`` and Oban's engines).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any, Protocol

from sqlalchemy import ColumnElement
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from jobrelay.storage.capabilities import Capabilities
from jobrelay.storage.drivers.postgres import PostgresDriver
from jobrelay.storage.drivers.sqlite import SqliteDriver
from jobrelay.storage.drivers.sqlite_local_queue import SqliteQueue
from jobrelay.storage.local_queue import Claimed as QueueClaimed
from jobrelay.storage.local_queue import ClaimResult, PortableQueue
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
)


class Driver(Protocol):
    """What a database backend implements. Each method keeps the guarantees ``port``
    states (the fence, the lock order, the one clock); ``tests/integration/test_store_contract``
    holds every driver to them, with its connections held and not."""

    capabilities: Capabilities

    @property
    def renewal_blocks_takeover(self) -> bool:
        """Whether a lease renewal that waits also holds off every takeover of its claims."""

    def hot_connections(self) -> contextlib.AbstractAsyncContextManager[None]:
        """Held by a worker or relay while it runs: the connections its hot statements use."""

    def intake_connections(self) -> contextlib.AbstractAsyncContextManager[None]:
        """Held by the API while it serves: the connections ``write_new_job`` uses."""

    async def write_new_job(self, job: NewJob, now: datetime) -> tuple[str, bool]:
        """The writes of one new job with no ``after=`` (``drivers.new_job``): ``(job_id,
        created)``. Each statement its own transaction on PostgreSQL (one: the job, its outbox
        row, its event), on the intake connections while they are held."""

    def now_sql(self, plus: timedelta = timedelta(0)) -> ColumnElement[datetime]:
        """The store's clock (+ ``plus``) as a SQL expression, for guards and lease ends."""

    async def db_now(self) -> datetime:
        """The store's clock as a value."""

    def upsert(self, table: Any) -> Any:
        """An ``INSERT`` with ``on_conflict_do_nothing``/``on_conflict_do_update``."""

    def minute_of(self, column: Any) -> ColumnElement[Any]:
        """``column`` (a time) truncated to its minute, as this database can group by it."""

    async def serialize_admission(self, conn: AsyncConnection) -> None:
        """Make ``conn``'s transaction the only one admitting jobs until it ends, so two
        relays never both give the same last slot (``storage.admission``)."""

    async def notify_outbox(self, conn: AsyncConnection) -> None:
        """Wake listening relays at ``conn``'s commit (a hint, never the only path)."""

    async def notify_done(self, conn: AsyncConnection) -> None:
        """Wake the waiters of ended jobs at ``conn``'s commit (``library.waiting``)."""

    async def cut_sessions(self) -> None:
        """Fault injection (``worker.after_complete:cut``): the server ends every other
        session of this database at once, as a failover does; nothing where there is no
        server (SQLite)."""

    async def claim_many(
        self,
        requests: Sequence[ClaimRequest],
        now: datetime,
        lease: timedelta,
        events: Sequence[PendingEvent] = (),
    ) -> list[Claimed]:
        """CLAIM for each request, each winning or losing on its own; in request order.
        ``events`` (``record_events``'s) are written in the same statement (PostgreSQL) or
        transaction (SQLite): the commit they would have cost of their own is the claim's."""

    async def complete_many(
        self,
        requests: Sequence[CompleteRequest],
        now: datetime,
        conn: AsyncConnection | None = None,
    ) -> Won:
        """COMPLETE for each request; the ids that won, and whether they gave back slots
        while a job is held back (``Won.wakes``; on PostgreSQL the statement NOTIFYs the
        relays at its commit). With ``conn``: inside that
        (write) transaction, which the caller commits; else in a transaction of its own."""

    async def turn(
        self,
        claims: Sequence[ClaimRequest],
        completions: Sequence[CompleteRequest],
        now: datetime,
        lease: timedelta,
        events: Sequence[PendingEvent] = (),
        conn: AsyncConnection | None = None,
    ) -> tuple[list[Claimed], Won]:
        """``complete_many`` and ``claim_many`` for distinct jobs in ONE statement
        (PostgreSQL) or transaction (SQLite): a worker's turn, one commit where they were
        two. Either both halves commit or neither. With ``conn``: inside that (write)
        transaction, which settles the jobs waiting for these (as ``complete_many``'s) and
        which the caller commits."""

    async def renew_many(self, claims: Sequence[Claim], lease: timedelta, now: datetime) -> Renewed:
        """RENEW for each claim."""

    async def record_events(self, events: Sequence[PendingEvent]) -> None:
        """Many state-less events at once; unknown jobs' skipped."""

    async def claim_outbox(
        self, relay_id: str, limit: int, claim_for: timedelta
    ) -> list[OutboxRow]:
        """Take up to ``limit`` waiting rows for ``claim_for``, skipping rows another holds."""

    async def mark_published(self, relay_id: str, rows: Sequence[OutboxRow]) -> int:
        """``published_at`` for confirmed rows not yet marked, one ``published`` event each."""


def open_driver(engine: AsyncEngine, clock: Clock | None) -> Driver:
    """The driver of ``engine``'s database: the one place that names the backend."""
    if engine.dialect.name == "postgresql":
        return PostgresDriver(engine, clock)
    return SqliteDriver(engine, clock)


class QueueDriver(Protocol):
    """The local transport's claims and settles (``transport.local``), fenced as
    ``storage.local_queue`` says; each a write transaction of its own."""

    def held(self) -> contextlib.AbstractAsyncContextManager[None]:
        """What its consumers hold while they consume (SQLite: a connection of their own)."""
        ...

    async def publish(self, rows: Sequence[Mapping[str, Any]], now: datetime) -> None:
        """New messages (each: queue, body, headers, available_at), one transaction."""
        ...

    async def claim(
        self,
        *,
        queue: str,
        consumer: str,
        now: datetime,
        invisible_until: datetime,
        limit: int,
        delivery_limit: int,
    ) -> ClaimResult: ...

    async def settle(
        self, consumer: str, settles: Sequence[tuple[QueueClaimed, bool]], now: datetime
    ) -> list[bool]:
        """(claim, reject) pairs: whether each was still held, and so settled."""
        ...


def open_queue_driver(engine: AsyncEngine) -> QueueDriver:
    """The local queue's driver of ``engine``'s database."""
    if engine.dialect.name == "sqlite":
        return SqliteQueue(engine)
    return PortableQueue(engine)


__all__ = ["Driver", "QueueDriver", "open_driver", "open_queue_driver"]
