"""The effects ledger's queries: one row per (job, kind) of external effect.

An operation with a side effect outside our database (an e-mail) asks ``begin`` before it
hands the effect over and reports ``mark_sent`` or ``mark_refused`` afterwards. Each call is
one short transaction that reads the row (locked on PostgreSQL, under SQLite's write lock),
asks the pure rules in ``domain/effects.py`` for the next state, writes it, and writes the
matching ``job_events`` row, so the job's timeline tells the same story as the ledger.

``begin`` is fenced like every write of a run: in the same transaction it reads the job (locked
on PostgreSQL, so a takeover's claim waits for it) and refuses an attempt whose claim no longer
holds it (the job is not ``running``, or runs a later attempt, or under another lease owner).
A superseded attempt, whose lease lapsed while it was slow and whose job another attempt now
runs, gets ``AttemptSuperseded`` and never ``send=True``: it would race the live attempt.

No transaction is held open while the effect itself happens: the SMTP conversation runs
between ``begin`` and ``mark_sent``, and a process that dies there leaves ``sending`` behind,
which is exactly the fact the next attempt needs.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import insert, select, update
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from jobrelay.domain.effects import (
    EffectState,
    state_after_refusal,
    state_after_send,
    state_before_send,
)
from jobrelay.domain.states import JobState
from jobrelay.errors import AttemptSuperseded, StoreError
from jobrelay.storage.engine import read_tx, write_tx
from jobrelay.storage.tables import effects_ledger, job_events, jobs


@dataclass(frozen=True)
class EffectRecord:
    job_id: str
    kind: str
    state: EffectState
    message_id: str
    attempts: int
    last_error: str | None
    sent_at: datetime | None
    updated_at: datetime


@dataclass(frozen=True)
class SendPermit:
    """``begin``'s answer: whether to hand the effect over now, and the row as written."""

    send: bool
    record: EffectRecord
    previous: EffectState | None


class EffectsLedger:
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    def _write(self) -> contextlib.AbstractAsyncContextManager[AsyncConnection]:
        return write_tx(self.engine, "effects ledger")

    async def _row(self, conn: AsyncConnection, job_id: str, kind: str) -> EffectRecord | None:
        query = select(effects_ledger).where(
            effects_ledger.c.job_id == job_id, effects_ledger.c.kind == kind
        )
        # FOR UPDATE where rows lock (SQLite compiles it to nothing: its write lock is whole).
        row = (await conn.execute(query.with_for_update())).first()
        return _record(row._mapping) if row is not None else None

    async def _event(
        self, conn: AsyncConnection, job_id: str, event: str, now: datetime, **detail: Any
    ) -> None:
        await conn.execute(
            insert(job_events).values(job_id=job_id, at=now, kind=event, detail=detail)
        )

    async def get(self, job_id: str, kind: str) -> EffectRecord | None:
        async with read_tx(self.engine, "effects ledger") as conn:
            return await self._row(conn, job_id, kind)

    async def _superseded(
        self, conn: AsyncConnection, job_id: str, attempt: int, worker: str | None
    ) -> dict[str, Any] | None:
        """None while the claim (``attempt``, ``worker``) holds the job and no operator has
        asked to cancel it (``storage.cancels``), else what holds it."""
        query = select(
            jobs.c.state, jobs.c.attempt, jobs.c.lease_owner, jobs.c.cancel_requested_at
        ).where(jobs.c.id == job_id)
        row = (await conn.execute(query.with_for_update())).first()
        if row is None:
            return {"currentState": None, "currentAttempt": None}
        if (
            row.state == JobState.RUNNING.value
            and row.attempt == attempt
            and worker is not None
            and row.lease_owner == worker
            and row.cancel_requested_at is None
        ):
            return None
        found = {"currentState": row.state, "currentAttempt": row.attempt}
        return found if row.cancel_requested_at is None else {**found, "cancelRequested": True}

    async def begin(
        self,
        job_id: str,
        kind: str,
        message_id: str,
        now: datetime,
        *,
        attempt: int,
        worker: str | None,
    ) -> SendPermit:
        """Record that attempt ``attempt`` is about to hand the effect over, or say it is done.

        A row left in ``sending`` by an earlier attempt means that attempt died with the
        outcome unknown: this one becomes ``possible_duplicate`` (and says so in the job's
        timeline) before it sends again with the same ``message_id``. An effect the ledger
        already records as delivered is skipped whoever asks; any other answer needs the
        caller's claim (``attempt`` run by lease owner ``worker``) to hold the job, else
        ``AttemptSuperseded`` (after an ``effect_fenced`` event, committed).
        """
        async with self._write() as conn:
            holder = await self._superseded(conn, job_id, attempt, worker)
            current = await self._row(conn, job_id, kind)
            previous = current.state if current is not None else None
            already_sent = current is not None and current.sent_at is not None
            target = state_before_send(previous, already_sent=already_sent)
            if target is None:
                assert current is not None
                await self._event(
                    conn,
                    job_id,
                    "effect_skipped",
                    now,
                    effect=kind,
                    state=current.state.value,
                    messageId=current.message_id,
                    attempt=attempt,
                )
                return SendPermit(send=False, record=current, previous=previous)
            if holder is not None:
                fenced = {"effect": kind, "attempt": attempt, "worker": worker, **holder}
                await self._event(conn, job_id, "effect_fenced", now, **fenced)
            else:
                record = await self._permit(
                    conn, job_id, kind, current, message_id, now, attempt, target
                )
        if holder is not None:
            raise AttemptSuperseded(
                f"attempt {attempt} no longer holds the job (it is {holder['currentState']}, "
                f"attempt {holder['currentAttempt']}): {kind} not sent"
            )
        return SendPermit(send=True, record=record, previous=previous)

    async def _permit(
        self,
        conn: AsyncConnection,
        job_id: str,
        kind: str,
        current: EffectRecord | None,
        message_id: str,
        now: datetime,
        attempt: int,
        target: EffectState,
    ) -> EffectRecord:
        """Write ``target`` (``sending`` or ``possible_duplicate``) and its event."""
        if current is None:
            await conn.execute(
                insert(effects_ledger).values(
                    job_id=job_id,
                    kind=kind,
                    state=target.value,
                    message_id=message_id,
                    attempts=1,
                    created_at=now,
                    updated_at=now,
                )
            )
        else:
            await conn.execute(
                update(effects_ledger)
                .where(effects_ledger.c.job_id == job_id, effects_ledger.c.kind == kind)
                .values(
                    state=target.value,
                    message_id=message_id,
                    attempts=effects_ledger.c.attempts + 1,
                    updated_at=now,
                )
            )
        detail = {"effect": kind, "messageId": message_id, "attempt": attempt}
        if target is EffectState.POSSIBLE_DUPLICATE:
            assert current is not None
            previous = current.state.value
            await self._event(conn, job_id, "possible_duplicate", now, previous=previous, **detail)
        else:
            await self._event(conn, job_id, "effect_sending", now, **detail)
        record = await self._row(conn, job_id, kind)
        assert record is not None
        return record

    async def mark_sent(self, job_id: str, kind: str, now: datetime) -> EffectRecord:
        """The other side accepted the effect: ``sent`` (or still ``possible_duplicate``)."""
        async with self._write() as conn:
            current = await self._required(conn, job_id, kind)
            target = state_after_send(current.state)
            await conn.execute(
                update(effects_ledger)
                .where(effects_ledger.c.job_id == job_id, effects_ledger.c.kind == kind)
                .values(
                    state=target.value,
                    sent_at=current.sent_at or now,
                    last_error=None,
                    updated_at=now,
                )
            )
            await self._event(
                conn,
                job_id,
                "effect_sent",
                now,
                effect=kind,
                state=target.value,
                messageId=current.message_id,
            )
            record = await self._required(conn, job_id, kind)
        return record

    async def mark_refused(self, job_id: str, kind: str, error: str, now: datetime) -> None:
        """The other side refused this attempt outright, so it certainly did not deliver."""
        async with self._write() as conn:
            current = await self._required(conn, job_id, kind)
            target = state_after_refusal(current.state)
            await conn.execute(
                update(effects_ledger)
                .where(effects_ledger.c.job_id == job_id, effects_ledger.c.kind == kind)
                .values(state=target.value, last_error=error[:2000], updated_at=now)
            )
            await self._event(
                conn, job_id, "effect_refused", now, effect=kind, state=target.value, error=error
            )

    async def _required(self, conn: AsyncConnection, job_id: str, kind: str) -> EffectRecord:
        record = await self._row(conn, job_id, kind)
        if record is None:
            raise StoreError(f"no effects ledger row for job {job_id} kind {kind}")
        return record


def _record(m: Any) -> EffectRecord:
    return EffectRecord(
        job_id=m["job_id"],
        kind=m["kind"],
        state=EffectState(m["state"]),
        message_id=m["message_id"],
        attempts=m["attempts"],
        last_error=m["last_error"],
        sent_at=m["sent_at"],
        updated_at=m["updated_at"],
    )
