"""The store port: the whole list of what a database backend must provide to jobrelay.

One class (``Store``) provides all of it, assembled from one module per concept over a driver
per database (``drivers``); so that its ~70 methods do not all become the contract, this
module names the contract: one small ``Protocol`` per concept, holding exactly the members
that code outside the store classes calls (the worker, the relay, the maintenance loops, the
operator tools, the API, the CLI, and the portable query classes and functions built on a
store: ``AdminQueries``, ``RepairQueries``, ``ScheduleQueries``, ``Retention``,
``queue_pauses``, ``limit_overrides``, ``heartbeats``, ``queue_progress``, ``dashboard``,
``audit``). ``StorePort`` is their union, plus ``capabilities``: the questions callers ask
instead of which database this is.

Each docstring states what a backend must *guarantee* (the fence, the lock order, the clock,
the transaction a write shares), not how a driver does it: a driver is correct when it keeps
these, and ``tests/integration/test_store_contract.py`` exercises them on each driver, with
its hot connections held and not. The module-level check at the bottom makes ``mypy
--strict`` fail the moment ``Store`` and the port drift apart.

Admin, repairs, schedules, retention, pauses and heartbeats are not members here: they are
portable SQLAlchemy Core (one shape for both databases) written over ``SqlAccess``, the
store's transactions, clock expression and shared writes. Those members expose SQLAlchemy:
they are what a backend SQLAlchemy cannot speak to would have to replace.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any, Protocol

from sqlalchemy import ColumnElement
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from jobrelay.domain.ids import IdKeys
from jobrelay.domain.messages import JobMessage
from jobrelay.domain.policy import JobView
from jobrelay.domain.states import JobState
from jobrelay.storage.admission import Admitted
from jobrelay.storage.cancels import CancelAsked
from jobrelay.storage.capabilities import Capabilities
from jobrelay.storage.effects import EffectsLedger
from jobrelay.storage.installation import Installation
from jobrelay.storage.outcomes import Completed
from jobrelay.storage.records import (
    Claim,
    Claimed,
    ClaimRequest,
    CompleteRequest,
    EventRecord,
    Fenced,
    JobLinks,
    JobRecord,
    NewJob,
    OutboxRow,
    PendingEvent,
    Renewed,
    TokenInfo,
    TokenRecord,
)
from jobrelay.storage.store import Store
from jobrelay.storage.transitions import Transition


class Connections(Protocol):
    """The database as a resource: what it can do, whether it answers, what a hot role holds."""

    @property
    def capabilities(self) -> Capabilities:
        """Fixed for the store's life; the only way a caller may tell backends apart."""
        ...

    @property
    def engine(self) -> AsyncEngine:
        """The pool; handed only to code that opens its own transactions (audit, app jobs)."""
        ...

    @property
    def installation(self) -> Installation:
        """The installation's row (id secret), read once per process and kept."""
        ...

    async def cut_sessions(self) -> None:
        """Fault injection only (``worker.after_complete:cut``): the database ends every other
        session, as a failover would."""

    async def ping(self) -> None:
        """Raises when the database cannot answer one statement now; changes nothing."""

    def hot_connections(self) -> contextlib.AbstractAsyncContextManager[None]:
        """While held, the claim/complete/renew/outbox statements run on connections this
        process keeps open; every guarantee below holds whether it is held or not."""

    def intake_connections(self) -> contextlib.AbstractAsyncContextManager[None]:
        """While held, a new job's writes (``submit`` without ``after=``) run on connections
        this process keeps open (the API's); the same statements, the same guarantees."""


class StoreClock(Protocol):
    """The ONE clock that judges leases, retries and due times: the database's, never a
    worker host's (``base`` explains why SQLite uses this process's clock instead)."""

    async def db_now(self) -> datetime:
        """The store's clock now, as the guards of the next statement will read it."""

    def local_now(self) -> datetime:
        """The store's clock read without a round trip; equal to ``db_now`` wherever the
        process owns the database's clock (SQLite, an injected test clock)."""

    def now_sql(self, plus: timedelta = timedelta(0)) -> ColumnElement[datetime]:
        """The store's clock (+ ``plus``) evaluated inside the statement that uses it, so a
        guard and the lease end it writes read the same instant."""


class Jobs(Protocol):
    """Accepting jobs and reading them back."""

    async def submit(self, job: NewJob, now: datetime) -> tuple[str, bool]:
        """The job row, its outbox message and its ``accepted`` event commit together or not
        at all; a repeat of an id already stored returns that id with ``False``."""

    async def get_job(self, job_id: str) -> JobRecord | None:
        """A committed row as it is now; None for an unknown id."""

    async def dependencies_of(self, job_id: str) -> list[JobRecord]:
        """The jobs ``job_id`` runs after (``after=``), in the order given."""

    async def links_of(self, job_id: str, shown: int = 20) -> JobLinks:
        """The first ``shown`` jobs ``job_id`` runs after and that wait for it, and counts."""

    async def job_exists(self, job_id: str) -> bool:
        """Whether a committed row has this id."""

    async def has_room(self, account_id: str, quota: int) -> bool:
        """May overshoot the quota only by what other processes accept in one recount
        window; an account found full is refused."""

    async def count_by_state(self) -> dict[str, int]:
        """Committed rows per state, for gauges: may lag, never invents a state."""

    async def id_keys(self, now: datetime) -> IdKeys:
        """The secrets job ids derive from at ``now``; every process of one installation gets
        the same answer, so an id computed anywhere names the same job."""


class Claims(Protocol):
    """Taking a job and holding it: every write after a claim is fenced on (id, ``running``,
    attempt), and a lease is judged by the store's clock only."""

    async def claim_job(
        self,
        job_id: str,
        worker_id: str,
        now: datetime,
        lease: timedelta,
        *,
        seen: JobView | None = None,
        **detail: Any,
    ) -> Claim | None:
        """At most one live claim per job: attempt += 1 and the lease taken in one guarded
        write, with its ``claimed`` event; None when the job is not claimable now."""

    async def claim_delivered(
        self,
        job_id: str,
        job_type: str,
        worker_id: str,
        now: datetime,
        lease: timedelta,
        **detail: Any,
    ) -> tuple[Claim, JobRecord, JobState] | None:
        """``claim_job`` in one round trip, returning the row it claimed and the state it
        left, so a stale delivery is told apart from a live one without a second read."""

    async def claim_many(
        self,
        requests: Sequence[ClaimRequest],
        now: datetime,
        lease: timedelta,
        events: Sequence[PendingEvent] = (),
    ) -> list[Claimed]:
        """``claim_delivered`` for distinct jobs, answered in request order; rows locked in
        id order so two batches never deadlock, and one bad row fails only itself.
        ``events`` (as ``record_events``) are written in the claims' commit."""

    async def renew_lease(self, claim: Claim, lease: timedelta, now: datetime) -> bool:
        """Extends the lease to the store's clock + ``lease`` only while ``claim`` holds."""

    async def renew_leases(
        self, claims: Sequence[Claim], lease: timedelta, now: datetime
    ) -> Renewed:
        """``renew_lease`` for many claims in one statement; the claims that still hold, and
        which of them an operator asked to cancel."""

    @property
    def renewal_blocks_takeover(self) -> bool:
        """True when a renewal that is still waiting also keeps every takeover waiting, so
        its lateness alone cannot cost the claim."""
        ...

    async def committed_by(self, claim: Claim, kind: str) -> bool:
        """Whether this very claim (not an earlier attempt) committed a ``kind`` event."""

    async def report_progress(self, claim: Claim, done: int, total: int, now: datetime) -> bool:
        """Fenced on the claim: a lost claim writes nothing and gets False."""


class Outcomes(Protocol):
    """How a claimed attempt ends: each is fenced on its claim and writes its event, and any
    message it sends, in the same transaction as the state."""

    async def complete(
        self,
        claim: Claim,
        result_key: str | None,
        result_meta: dict[str, Any],
        now: datetime,
        follow_ups: Sequence[NewJob] = (),
        publish: Callable[[], Awaitable[None]] | None = None,
    ) -> Fenced:
        """running -> succeeded; ``publish`` runs while the job's row is locked and before
        the commit (its failure rolls back), and ``follow_ups`` commit in the same
        transaction, so a stale attempt never replaces the winner's result."""

    async def complete_many(self, requests: Sequence[CompleteRequest], now: datetime) -> Completed:
        """``complete`` for many claims in one statement, rows locked in id order; the ids
        whose fence held. Requests with a step of their own (``publish``, ``follow_ups``)
        share one write transaction, each winner's steps before the commit; one whose step
        raised is left out (``Completed.failed``) and the others committed without it."""

    async def turn(
        self,
        claims: Sequence[ClaimRequest],
        completions: Sequence[CompleteRequest],
        now: datetime,
        lease: timedelta,
        events: Sequence[PendingEvent] = (),
    ) -> tuple[list[Claimed], Completed]:
        """``complete_many`` and ``claim_many`` of distinct jobs in one commit: a worker's
        turn. With completions that have a step of their own, the claims ride in their write
        transaction, sent again with it when a step fails (and alone if every one did)."""

    async def schedule_retry(
        self,
        claim: Claim,
        job_type: str,
        error: str,
        delay: float,
        now: datetime,
        *,
        hold: bool = False,
        public: str | None = None,
        asked_delay: float | None = None,
        traceback: str | None = None,
    ) -> Fenced:
        """running -> retry_wait with its retry message in the outbox, in one transaction:
        through the delay route, or with ``hold`` waiting in the outbox until due."""

    async def quarantine(
        self,
        job_id: str,
        reason: str,
        now: datetime,
        *,
        claim: Claim | None = None,
        seen: JobView | None = None,
        public: str | None = None,
        traceback: str | None = None,
        **detail: Any,
    ) -> bool:
        """-> quarantined, guarded on the claim, or on the state ``seen`` was read in: a bad
        copy read while ``queued`` never quarantines a job a good copy has claimed since."""

    async def defer(
        self,
        job_id: str,
        message: JobMessage | bytes,
        delay: int,
        reason: str,
        now: datetime,
        *,
        headers: Mapping[str, str] | None = None,
        **detail: Any,
    ) -> None:
        """No state change: the message to look again later and its event, committed together."""


class Admission(Protocol):
    """Limits per key, applied before the broker (``storage.admission``)."""

    async def awaits_admission(self) -> bool:
        """Whether any outbox row waits for its job's admission (a cheap read)."""

    async def admit_waiting(
        self,
        budget: int,
        fair_ahead: int | None = None,
        claim_for: tuple[str, timedelta] | None = None,
        priority_ahead: int | None = None,
    ) -> Admitted:
        """Admit up to ``budget`` jobs whose next message waits for their limits: each only
        when every limit has room (a concurrency limit's slots held below its max, a rate
        limit's bucket holding a token), highest priority first, in turns across keys,
        serialised across relays; the
        slots are given back by the transaction that ends the run. With ``claim_for`` (a
        relay's id, for how long) the admitted rows are claimed for that relay too."""


class Outbox(Protocol):
    """The messages written beside states, handed to relays: nothing here talks to a broker."""

    async def claim_outbox(
        self, relay_id: str, limit: int, claim_for: timedelta
    ) -> list[OutboxRow]:
        """Due rows no other relay holds now (relays claim side by side without waiting on
        each other); a row claimed and never marked is claimable again after ``claim_for``."""

    async def mark_published(self, relay_id: str, rows: Sequence[OutboxRow]) -> int:
        """Marks each row published at most once, with one event each; the count newly marked."""

    async def release_outbox(self, row: OutboxRow, error: str, backoff: timedelta) -> None:
        """The row stays unpublished and becomes claimable again after ``backoff``."""

    async def seconds_to_next_due(self) -> float | None:
        """Time by the store's clock until the earliest held row falls due; None: none held."""

    @property
    def outbox_listeners(self) -> list[asyncio.Event]:
        """Events a relay in this process registers; set after every commit that wrote outbox
        rows, so a same-process relay needs no database notification."""
        ...

    def wake_relays(self) -> None:
        """Sets every registered listener; called after (never before) the commit."""


class Events(Protocol):
    """The job timeline every reader shows."""

    async def events(self, job_id: str) -> list[EventRecord]:
        """A job's committed events in the order they were written."""

    async def record_event(self, job_id: str, kind: str, now: datetime, **detail: Any) -> None:
        """An event with no state change; an unknown job's is dropped, never an error."""

    async def record_events(self, events: Sequence[PendingEvent]) -> None:
        """``record_event`` for many in one round trip, unknown jobs' skipped."""


class Cancels(Protocol):
    """An operator's cancel of a running job, carried out by its worker or, if it died, the
    reconciler: the state changes only under a guard."""

    async def request_cancel(
        self, job_id: str, *, actor: str, reason: str, now: datetime
    ) -> CancelAsked:
        """The request and its event commit together; a job not ``running`` is unchanged."""

    async def end_cancelled(self, claim: Claim, now: datetime) -> bool:
        """running -> cancelled, fenced on the claim, only once a cancel was requested."""

    async def end_abandoned(self, job_id: str, now: datetime) -> bool:
        """running -> cancelled for a requested cancel whose lease expired by the store's
        clock; a live lease is never ended here."""


class Tokens(Protocol):
    """API tokens, stored as hashes only."""

    async def add_token(
        self,
        token_hash: str,
        account_id: str | None,
        is_admin: bool,
        now: datetime,
        label: str | None = None,
        expires_at: datetime | None = None,
    ) -> int:
        """Stores the hash (never the token); the new row's id."""

    async def find_token(self, token_hash: str) -> TokenRecord | None:
        """A valid token's record; may be served from memory for a few seconds, so a revoke
        takes at most that long to be seen here."""

    async def may_be_valid(self, token_hash: str) -> bool:
        """A cheap pre-check: False only for a hash that is surely not valid."""

    async def token_identity(self, token_hash: str) -> tuple[int, str | None] | None:
        """Read past any cache: a revoked or expired token is refused from the moment of
        its revoke."""

    async def list_tokens(self, token_id: int | None = None) -> list[TokenInfo]:
        """Tokens oldest first, never their hashes."""

    async def revoke_token(self, token_id: int) -> TokenInfo | None:
        """Idempotent: a second revoke keeps the first revoke's time."""


class Effects(Protocol):
    """External effects of jobs (e-mails sent), recorded in the same database."""

    @property
    def effects(self) -> EffectsLedger:
        """The ledger that keeps an effect from being performed twice for one job."""
        ...


class SqlAccess(Protocol):
    """What the portable SQLAlchemy Core queries (admin, repairs, schedules, retention,
    pauses, heartbeats, progress, dashboard, audit) are written over: the store's
    transactions and the writes more than one concept shares."""

    def reading(self) -> contextlib.AbstractAsyncContextManager[AsyncConnection]:
        """A transaction that writes nothing; a driver's error surfaces as ``StoreError``."""

    def writing(self) -> contextlib.AbstractAsyncContextManager[AsyncConnection]:
        """One transaction, committed on exit and rolled back on error; a driver's error
        surfaces as ``StoreError``. Relays are not woken: a caller that wrote outbox rows
        calls ``wake_relays`` after it."""

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
        """A declared state change (``transitions``), guarded on the legal or given sources
        plus ``where``, in the caller's transaction (its event is the caller's to add, with
        what it knows); ``values`` are its request's; False: the guard lost, nothing
        written."""

    async def add_event(
        self, conn: AsyncConnection, job_id: str, kind: str, now: datetime, **detail: Any
    ) -> None:
        """An event in the caller's transaction, so it commits with the change it records."""

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
        """The job's next message (of its type, or a raw body) to its queue, or with
        ``delay`` through the delay route: an outbox row in the caller's transaction, held
        until ``available_at`` if given, carrying the job's trace unless ``headers``."""

    def upsert(self, table: Any) -> Any:
        """An INSERT that can take ``on_conflict_do_update``, in this database's dialect."""

    def job_query(self) -> Any:
        """The SELECT every ``JobRecord`` is read with, so all readers see the same columns."""

    def minute_of(self, column: Any) -> ColumnElement[Any]:
        """``column`` (a time) truncated to its minute, as the database can group by it."""


class StorePort(
    Connections,
    StoreClock,
    Jobs,
    Claims,
    Outcomes,
    Outbox,
    Admission,
    Events,
    Cancels,
    Tokens,
    Effects,
    SqlAccess,
    Protocol,
):
    """Everything a backend provides; code outside storage holds a store by this type."""


def _store_keeps_the_port(store: Store) -> StorePort:
    """Never called: mypy checks this return, so ``Store`` and the port cannot drift apart."""
    return store
