"""The outcome of a run, fenced on its claim: complete, retry, quarantine; and a deferral.

A completion is the driver's one COMPLETE statement (``transitions.COMPLETE``), for one job
or a batch. A completion with a step of its own (publish a staged result, create follow-ups)
runs the same statement in a write transaction with those steps before the commit (River's
``job_complete_tx``): the guarded UPDATE that proves the claim holds also holds the job's row
lock (PostgreSQL) or the write lock (SQLite) until the commit, so a stale attempt can never
replace the object the winning attempt committed, and a success never lands without its
follow-ups. A worker's turn (its completions and the claims of its next jobs, one commit)
sends its claims in that transaction too. Retry and quarantine are portable SQLAlchemy
statements over the same declarations (``transitions.RETRY``, ``QUARANTINE``).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from jobrelay.domain.disclosure import public_detail
from jobrelay.domain.messages import JobMessage
from jobrelay.domain.policy import JobView
from jobrelay.domain.queues import DEFAULT_QUEUE
from jobrelay.domain.states import JobState
from jobrelay.errors import InvalidDependencies, StoreDataError
from jobrelay.storage.claims import ClaimsStore
from jobrelay.storage.dependencies import finish_steps
from jobrelay.storage.drivers.new_job import steps_on
from jobrelay.storage.records import (
    Claim,
    Claimed,
    ClaimRequest,
    CompleteRequest,
    Fenced,
    NewJob,
    PendingEvent,
    Won,
)
from jobrelay.storage.steps import run_async
from jobrelay.storage.storable import safe_text
from jobrelay.storage.tables import jobs
from jobrelay.storage.transitions import QUARANTINE, RETRY, Inputs, fenced, values_of


class _StepFailed(Exception):
    """A completion's own step failed: its transaction is rolled back and sent again
    without that completion."""


class Completed(frozenset[str]):
    """The ids of the completions that won, and ``failed``: the completions whose own step
    (the publication of their staged result) raised, by job id, with what it raised. Those
    were not committed; every other completion of the batch was answered on its own."""

    failed: Mapping[str, Exception]

    def __new__(
        cls, won: Iterable[str] = (), failed: Mapping[str, Exception] | None = None
    ) -> Completed:
        completed = super().__new__(cls, won)
        completed.failed = dict(failed or {})
        return completed


async def _publish_all(requests: Sequence[CompleteRequest], failed: dict[str, Exception]) -> None:
    """The winners' staged results made visible side by side, inside their completion's
    transaction: their renames then share one ``fsync`` per directory
    (``results.files.DirectorySyncs``). One that raises is in ``failed``, and the
    transaction is rolled back (``_StepFailed``); a publication that did land is not undone,
    and its next try (the transaction sent again) has nothing left to do."""
    publishing = [r for r in requests if r.publish is not None]
    outcomes = await asyncio.gather(
        *(r.publish() for r in publishing if r.publish is not None), return_exceptions=True
    )
    for request, outcome in zip(publishing, outcomes, strict=True):
        if isinstance(outcome, Exception):
            failed[request.claim.job_id] = outcome
        elif isinstance(outcome, BaseException):
            raise outcome
    if any(r.claim.job_id in failed for r in publishing):
        raise _StepFailed


@dataclass(frozen=True)
class _Riding:
    """A turn's claims and events, riding in its completions' transaction."""

    claims: Sequence[ClaimRequest]
    lease: timedelta
    events: Sequence[PendingEvent]

    async def alone(self, store: ClaimsStore, now: datetime) -> list[Claimed]:
        """Every completion beside them failed its step: they commit by themselves."""
        return await store.claim_many(self.claims, now, self.lease, self.events)


class OutcomesStore(ClaimsStore):
    async def complete_many(self, requests: Sequence[CompleteRequest], now: datetime) -> Completed:
        """Fenced completions, each winning or losing on its own, BEFORE their deliveries
        are acked: one statement in autocommit when none has a step of its own, else one
        write transaction with each winner's steps before the commit.

        A step that raises (a staged result that cannot be published) rolls the transaction
        back; it is sent again without that completion, whose error is in ``failed``: one
        job's failed publication never costs its neighbours their outcome.
        """
        if not any(r.in_transaction for r in requests):
            return await self._after_hot(
                requests, await self.driver.complete_many(requests, now), now
            )
        _, done = await self._in_transactions(requests, Won(), now)
        return done

    async def turn(
        self,
        claims: Sequence[ClaimRequest],
        completions: Sequence[CompleteRequest],
        now: datetime,
        lease: timedelta,
        events: Sequence[PendingEvent] = (),
    ) -> tuple[list[Claimed], Completed]:
        """A worker's turn: ``complete_many`` and ``claim_many`` of distinct jobs (and the
        events riding on them) in ONE commit where they were two: one statement, or, when a
        completion has a step of its own, the completions' write transaction. A failed
        statement fails both halves; a failure after it (the jobs others wait for, completed
        again in a transaction) is in ``Completed.failed`` for those jobs only."""
        if not completions:
            return await self.claim_many(claims, now, lease, events), Completed()
        if not claims and not events:
            return [], await self.complete_many(completions, now)
        if any(r.in_transaction for r in completions):
            return await self._in_transactions(
                completions, Won(), now, _Riding(claims, lease, events)
            )
        claimed, hot = await self.driver.turn(claims, completions, now, lease, events)
        try:
            return claimed, await self._after_hot(completions, hot, now)
        except Exception as exc:
            # The jobs others wait for, completed again in a transaction of their own that
            # failed: theirs alone. The claims committed, and are answered.
            return claimed, Completed(hot, dict.fromkeys(hot.deferred, exc))

    async def _after_hot(
        self, requests: Sequence[CompleteRequest], hot: Won, now: datetime
    ) -> Completed:
        """What the hot statement left: the relays woken for freed slots, and the jobs
        others wait for completed again in a transaction that settles those."""
        if hot.wakes:
            self.wake_relays()
        if not hot.deferred:
            return Completed(hot)
        _, done = await self._in_transactions(
            [r for r in requests if r.claim.job_id in hot.deferred], hot, now
        )
        return done

    async def _in_transactions(
        self,
        requests: Sequence[CompleteRequest],
        hot: Won,
        now: datetime,
        riding: _Riding | None = None,
    ) -> tuple[list[Claimed], Completed]:
        """The completions in one write transaction, each winner's steps before the commit;
        sent again without a completion whose step failed. The claims (and events) of a
        turn ride in it: rolled back with it, sent again with it, committed once with the
        completions that are left, even when none is."""
        failed: dict[str, Exception] = {}
        while True:
            todo = [r for r in requests if r.claim.job_id not in failed]
            if not todo:
                claimed = [] if riding is None else await riding.alone(self, now)
                return claimed, Completed(hot, failed)
            try:
                claimed, won = await self._complete_in_transaction(todo, now, failed, riding)
            except _StepFailed:
                continue
            if (
                won.wakes
                or won.dependants
                or any(r.follow_ups and r.claim.job_id in won for r in todo)
            ):
                self.wake_relays()
            return claimed, Completed(hot | won, failed)

    async def _complete_in_transaction(
        self,
        requests: Sequence[CompleteRequest],
        now: datetime,
        failed: dict[str, Exception],
        riding: _Riding | None,
    ) -> tuple[list[Claimed], Won]:
        claimed: list[Claimed] = []
        async with self.writing() as conn:
            if riding is None:
                won = await self.driver.complete_many(requests, now, conn)
            else:
                claimed, won = await self.driver.turn(
                    riding.claims, requests, now, riding.lease, riding.events, conn
                )
            if won.dependants:
                # The next statement: it sees the edges of every enqueue this one waited for.
                ended = dict.fromkeys(sorted(won.dependants), JobState.SUCCEEDED.value)
                await run_async(conn, finish_steps(self.capabilities.listens, ended, now))
            winners = [r for r in requests if r.claim.job_id in won]
            await _publish_all(winners, failed)
            for request in winners:
                for follow_up in request.follow_ups:
                    try:
                        await self.add_follow_up(conn, request.claim.job_id, follow_up, now)
                    except InvalidDependencies as exc:
                        # This job's own data (its follow-up's ``after=``), never its
                        # neighbours': its outcome is refused, and it is quarantined with why.
                        failed[request.claim.job_id] = StoreDataError(f"follow-up: {exc}")
                        raise _StepFailed from exc
        return claimed, won

    async def complete(
        self,
        claim: Claim,
        result_key: str | None,
        result_meta: dict[str, Any],
        now: datetime,
        follow_ups: Sequence[NewJob] = (),
        publish: Callable[[], Awaitable[None]] | None = None,
    ) -> Fenced:
        """``complete_many`` of one: running -> succeeded with its result key, BEFORE the
        delivery is acked. A ``publish`` that fails raises, and nothing is committed."""
        request = CompleteRequest(claim, result_key, result_meta, publish, tuple(follow_ups))
        done = await self.complete_many([request], now)
        if claim.job_id in done.failed:
            raise done.failed[claim.job_id]
        if claim.job_id in done:
            return Fenced(True)
        return await self.current(None, claim.job_id)

    async def add_follow_up(
        self, conn: AsyncConnection, parent_id: str, job: NewJob, now: datetime
    ) -> None:
        """A job created by its parent's success, in the parent's transaction: the same
        writes as any new job (``new_job``), and the parent's ``follow_up_accepted``."""
        job = replace(job, parent_job_id=parent_id)
        _, created = await run_async(conn, steps_on(conn, job, now))
        if not created:
            return  # created by an earlier success of the same parent
        await self.add_event(
            conn, parent_id, "follow_up_accepted", now, jobId=job.job_id, type=job.type
        )

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
        """running -> retry_wait, and the retry message into the outbox, in one transaction.

        Fenced on the claim; the due time is the store's clock + ``delay``. The message goes
        through the delay route's tier ``delay`` (whole seconds), or with ``hold`` (a
        back-off's delay, any number of seconds) waits in the outbox until due. ``asked_delay``
        (kept in the event) is what the job asked with ``Retry(delay=)``. ``public`` is the
        error as the job's account reads it (``domain.disclosure``); ``error`` the operators',
        and ``traceback`` where the run raised (``worker.failures``; None clears an earlier
        one). All are stored with their NUL bytes escaped (``storable``): they must not make
        the write fail.
        """
        error = safe_text(error)
        i = Inputs(
            now=now,
            clock=self.now_sql(),
            lease_ends=self.now_sql(timedelta(seconds=delay)),
            req=values_of(
                {
                    "id": claim.job_id,
                    "attempt": claim.attempt,
                    "worker": claim.worker_id,
                    "error": error[:4000],
                    "public": None if public is None else safe_text(public),
                    "traceback": None if traceback is None else safe_text(traceback),
                }
            ),
        )
        async with self.writing() as conn:
            result = await conn.execute(
                update(jobs)
                .where(jobs.c.id == claim.job_id, *RETRY.guards(i))
                .values(**RETRY.sets(i))
                .returning(jobs.c.next_attempt_at, jobs.c.queue, jobs.c.limits)
            )
            row = result.first()
            if row is None:
                return await self.current(conn, claim.job_id)
            await self.release_slots(conn, RETRY, claim.job_id)
            if hold or row.limits:
                # Held in the outbox until due. Under limits, then admitted: a message in a
                # delay queue would hold its slots through the whole delay.
                await self.next_message(
                    conn, claim.job_id, job_type, row.queue, now, available_at=row.next_attempt_at
                )
            else:
                tier = math.ceil(delay)
                await self.next_message(conn, claim.job_id, job_type, row.queue, now, delay=tier)
            await self.add_event(
                conn,
                claim.job_id,
                "retry_scheduled",
                now,
                error=error,
                delaySeconds=delay if isinstance(delay, int) else round(delay, 3),
                **({} if asked_delay is None else {"askedDelaySeconds": asked_delay}),
                nextAttemptAt=row.next_attempt_at,
                attempt=claim.attempt,
                worker=claim.worker_id,
                **public_detail(i.req("public")),
            )
        self.wake_relays()
        return Fenced(True)

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
        """-> quarantined with the reason kept.

        With ``claim`` (the worker's own run failed for good) only while that claim holds;
        with ``seen`` (a delivery-time decision) only if the job is still exactly as the
        policy saw it: same state, same attempt, same lease. A bad copy read while the job
        was ``queued`` therefore never quarantines a job a good copy has claimed since.
        The reason is stored with its NUL bytes escaped (``storable``). A worker's quarantine
        (``claim``) also stores ``traceback``, where its run raised (None clears an earlier
        one); a delivery-time one ran nothing and keeps the last failure's.
        """
        reason = safe_text(reason)
        public = None if public is None else safe_text(public)
        i = Inputs(
            now=now,
            clock=self.now_sql(),
            req=values_of({"reason": reason[:4000], "public": public}),
        )
        where: list[Any] = [jobs.c.id == job_id, *QUARANTINE.guards(i)]
        values = QUARANTINE.sets(i)
        if claim is not None:
            where += fenced(claim)
            detail = {**detail, "attempt": claim.attempt, "worker": claim.worker_id}
            values["last_traceback"] = None if traceback is None else safe_text(traceback)
        if seen is not None:
            where += self.as_seen(seen)
        wakes = False
        async with self.writing() as conn:
            won = (await conn.execute(update(jobs).where(*where).values(**values))).rowcount == 1
            if won:
                wakes = await self.release_slots(conn, QUARANTINE, job_id)
                await self.add_event(
                    conn,
                    job_id,
                    "quarantined",
                    now,
                    reason=reason,
                    **detail,
                    **public_detail(public),
                )
        if wakes:
            self.wake_relays()  # a slot freed, or a job that ran after it queued
        return bool(won)

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
        """Re-check a job later through the delay route: an outbox row, no state change.

        ``message`` may be the raw body of a delivery this worker cannot read (a type or
        version only newer workers know): it is passed on unchanged, with ``headers`` added.
        ``detail``: more of the ``deferred`` event (who deferred it, which deferral).
        """
        async with self.writing() as conn:
            queue = await conn.scalar(select(jobs.c.queue).where(jobs.c.id == job_id))
            body = message if isinstance(message, bytes) else message.encode()
            await self.next_message(
                conn, job_id, body, queue or DEFAULT_QUEUE, now, delay=delay, extra_headers=headers
            )
            await self.add_event(
                conn, job_id, "deferred", now, reason=reason, delaySeconds=delay, **detail
            )
        self.wake_relays()
