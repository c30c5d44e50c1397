"""Admission: the relay hands a job under limits to the broker only once its limits have room.

Before each claim of outbox rows the relay admits what it can (``admit_waiting``), in one
write transaction serialised across relays (the driver's ``serialize_admission``): the jobs
whose next message waits, under limits and not admitted, oldest first; the slots each limit
id holds now (``job_slots``), its bucket's tokens and the operators' overrides; the rules'
answer (``domain.limits.admit``: in turns across keys); then each admitted job's
``admitted_at``, its slots and its ``admitted`` event, the buckets' new tokens, and a
``throttled`` event for a job held back the first time. Its rows are then claimed and sent as
any other (``outbox_admissible``); the slots are given back by the transaction that ends the
run (``transitions.Transition.releases``). So the broker never holds a job that cannot run.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Select, Text, cast, func, insert, literal, or_, select, update

from jobrelay import fastjson
from jobrelay.domain.limits import (
    CONCURRENCY,
    FAIR,
    PRIORITY,
    RATE,
    Bucket,
    Candidate,
    JobLimit,
    Override,
    admit,
    limiting,
    split_id,
)
from jobrelay.storage.base import StoreBase
from jobrelay.storage.delayed import outbox_due
from jobrelay.storage.records import OutboxRow, outbox_row
from jobrelay.storage.tables import (
    OUTBOX_CLAIMED,
    UTCDateTime,
    job_slots,
    jobs,
    limit_buckets,
    limit_overrides,
    outbox,
)
from jobrelay.storage.transitions import awaiting_admission

# The waiting jobs of each turn key a round considers: a key with room for more is admitted
# more at the next round, which follows at once (an admission wakes the relay). More would
# make every round read and weigh each key's backlog (measured: 17 ms of a 28 ms round
# over 1,024 rows of 10 keys, against 3 ms with 32 a key).
PER_KEY = 32


@dataclass(frozen=True)
class Admitted:
    admitted: int
    held: int
    # For the relay's metrics: the jobs held back for the first time, and each admitted
    # job's type and how long it had been held (0: admitted at its first round).
    throttled: int = 0
    waits: tuple[tuple[str, float], ...] = ()
    # The admitted jobs' outbox rows, claimed by the admission for the relay that asked
    # (``claim_for``): it publishes them without a claim of its own.
    rows: tuple[OutboxRow, ...] = ()


def _held_reason(limit: JobLimit, slots: int) -> str:
    name, key = split_id(limit.limit_id)
    who = name if key is None else f"{name} {key}"
    if limit.kind == FAIR:
        return f"{name} has {slots} jobs handed to the broker and not yet ended (fair by key)"
    if limit.kind == PRIORITY:
        return f"{name} has {slots} jobs handed to the broker and not yet ended (by priority)"
    if limit.kind == CONCURRENCY:
        return f"{who} has {slots} of {limit.max} running"
    return f"{who} is at its rate ({limit.per_second:g}/s)"


def _throttled(limit: JobLimit, slots: Mapping[str, int]) -> dict[str, Any]:
    name, key = split_id(limit.limit_id)
    return {"limit": name, "key": key, "reason": _held_reason(limit, slots.get(limit.limit_id, 0))}


@functools.lru_cache(maxsize=4096)
def _limits(text: str | None) -> tuple[JobLimit, ...]:
    """A job's limits from their stored text; the same text (a key's jobs) parsed once."""
    return tuple(JobLimit.from_json(limit) for limit in fastjson.loads(text or "[]") or ())


def _admitted(limits: Sequence[JobLimit]) -> dict[str, Any]:
    return {
        "limits": [split_id(limit.limit_id)[0] for limit in limits],
        "keys": [split_id(limit.limit_id)[1] for limit in limits],
        "rate": any(limit.kind == RATE for limit in limits),
    }


def waiting_ranked(now: datetime, per_key: int, limit: int) -> Select[Any]:
    """The outbox rows (``id``, ``job_id``) of the oldest ``per_key`` waiting jobs of every
    turn key (``jobs.turn_key``), in turns, not the oldest of all: a key's backlog of
    thousands leaves room in the round for another's job.

    Each row's key is read by a scalar subquery on the job's primary key, not by a join:
    PostgreSQL plans a join from its statistics, and with ``reltuples`` = 0 on tables that
    hold thousands of rows (a ``VACUUM`` that saw them empty) it joined ``jobs`` by scanning
    its whole primary key per waiting row (1.3-7.5 s a round); a scalar subquery is looked
    up by the key it names whatever the statistics say.

    Due by ``now``, the one reading of the clock the round stamps its rows with: judged by a
    second reading, a row due between the two was sent stamped before its run time."""
    waiting = (
        select(
            outbox.c.id,
            outbox.c.job_id,
            select(jobs.c.turn_key)
            .where(jobs.c.id == outbox.c.job_id)
            .scalar_subquery()
            .label("turn_key"),
            select(func.coalesce(jobs.c.priority, 0))
            .where(jobs.c.id == outbox.c.job_id)
            .scalar_subquery()
            .label("priority"),
        )
        .where(
            outbox.c.published_at.is_(None),
            outbox.c.awaiting_admission.is_(True),
            or_(outbox.c.claimed_until.is_(None), outbox.c.claimed_until < now),
            outbox_due(literal(now, UTCDateTime())),
        )
        .subquery()
    )
    ranked = select(
        waiting.c.id,
        waiting.c.job_id,
        func.row_number()
        .over(partition_by=waiting.c.turn_key, order_by=(waiting.c.priority.desc(), waiting.c.id))
        .label("turn"),
    ).subquery()
    return (
        select(ranked.c.id, ranked.c.job_id)
        .where(ranked.c.turn <= per_key)
        # Each key's jobs are ranked highest priority first (a prioritized queue's share
        # its key): priority is never compared across keys (``domain.limits.in_turns``).
        .order_by(ranked.c.turn, ranked.c.id)
        .limit(limit)
    )


def waiting_jobs(job_ids: Sequence[str]) -> Select[Any]:
    """The ranked rows' jobs, by primary key (a statement of its own, for the reason above)."""
    return select(
        jobs.c.id,
        jobs.c.type,
        # As text: the jobs of one key share one text, parsed once (``_limits``).
        cast(jobs.c.limits, Text).label("limits"),
        jobs.c.throttled_at,
        jobs.c.priority,
        awaiting_admission().label("waits"),
    ).where(jobs.c.id.in_(job_ids))


class AdmissionStore(StoreBase):
    async def awaits_admission(self) -> bool:
        """Whether a row waits for its job's admission (read with ``ix_outbox_awaiting``, an
        index with no entry when none does): a relay skips the admission's write
        transaction and its lock when nothing waits."""
        async with self.reading() as conn:
            found = await conn.scalar(
                select(outbox.c.id)
                .where(outbox.c.published_at.is_(None), outbox.c.awaiting_admission.is_(True))
                .limit(1)
            )
        return found is not None

    async def admit_waiting(
        self,
        budget: int,
        fair_ahead: int | None = None,
        claim_for: tuple[str, timedelta] | None = None,
        priority_ahead: int | None = None,
    ) -> Admitted:
        """Admit up to ``budget`` of the jobs whose message waits for their limits;
        ``fair_ahead``, ``priority_ahead``: how many jobs of a fair type, of a prioritized
        queue, may be admitted and not yet ended;
        ``claim_for`` (a relay's id, for how long): the admitted jobs' rows are claimed for
        that relay in the same write (``Admitted.rows``), as ``claim_outbox`` would: one
        write of each row instead of two (measured: the admission's writes were +39 % of
        the WAL a job writes)."""
        async with self.writing() as conn:
            await self.driver.serialize_admission(conn)
            now = await conn.scalar(select(self.now_sql()))
            assert isinstance(now, datetime)
            ranked = (
                await conn.execute(waiting_ranked(now, min(budget, PER_KEY), budget * 4))
            ).all()
            if not ranked:
                return Admitted(0, 0)
            found = {
                r.id: r
                for r in await conn.execute(waiting_jobs(sorted({r.job_id for r in ranked})))
            }
            # A row whose job no longer waits (cancelled while it waited) goes on as any row
            # of a finished job: the worker acks it unrun.
            ended = [r.id for r in ranked if not (r.job_id in found and found[r.job_id].waits)]
            if ended:
                await conn.execute(
                    update(outbox).where(outbox.c.id.in_(ended)).values(awaiting_admission=False)
                )
            candidates: dict[str, Candidate] = {}
            first_held: dict[str, Any] = {}
            types: dict[str, str] = {}
            for order, job in enumerate(found[r.job_id] for r in ranked if r.job_id in found):
                if job.id in candidates or not job.waits:
                    continue
                candidates[job.id] = Candidate(
                    job.id, _limits(job.limits), order, priority=job.priority or 0
                )
                first_held[job.id] = job.throttled_at
                types[job.id] = job.type
            if not candidates:
                return Admitted(0, 0)
            ids = {limit.limit_id for c in candidates.values() for limit in c.limits}
            names = {split_id(i)[0] for i in ids}
            held = {
                r.limit_id: int(r.n)
                for r in await conn.execute(
                    select(job_slots.c.limit_id, func.count().label("n"))
                    .where(job_slots.c.limit_id.in_(sorted(ids)))
                    .group_by(job_slots.c.limit_id)
                )
            }
            buckets = {
                r.limit_id: Bucket(float(r.tokens), r.at.timestamp())
                for r in await conn.execute(
                    select(limit_buckets).where(limit_buckets.c.limit_id.in_(sorted(ids)))
                )
            }
            overrides = {
                r.limit_id: Override(r.max, r.per_second, r.burst)
                for r in await conn.execute(
                    select(limit_overrides).where(
                        limit_overrides.c.limit_id.in_(sorted(ids | names))
                    )
                )
            }
            answer = admit(
                list(candidates.values()),
                held,
                buckets,
                now.timestamp(),
                overrides,
                room=budget,
                fair_ahead=fair_ahead,
                priority_ahead=priority_ahead,
            )
            rows_of: dict[str, list[int]] = {}
            for r in ranked:
                rows_of.setdefault(r.job_id, []).append(r.id)
            admitted, claimed = await self._write(
                conn, answer.admitted, candidates, first_held, now, claim_for, rows_of
            )
            newly_held = [j for j in answer.held if first_held.get(j) is None]
            if newly_held:
                await conn.execute(
                    update(jobs).where(jobs.c.id.in_(newly_held)).values(throttled_at=now)
                )
                await self.add_events(
                    conn,
                    "throttled",
                    now,
                    {
                        job_id: _throttled(answer.held[job_id], answer.slots)
                        for job_id in newly_held
                    },
                )
            for limit_id, tokens in answer.buckets.items():
                await conn.execute(
                    self.upsert(limit_buckets)
                    .values(limit_id=limit_id, tokens=tokens, at=now)
                    .on_conflict_do_update(
                        index_elements=[limit_buckets.c.limit_id],
                        set_={"tokens": tokens, "at": now},
                    )
                )
        if admitted:
            self.wake_relays()
        waits = tuple(
            (types[j], max(0.0, (now - first_held[j]).total_seconds()) if first_held[j] else 0.0)
            for j in admitted
        )
        return Admitted(len(admitted), len(answer.held), len(newly_held), waits, tuple(claimed))

    async def _write(
        self,
        conn: Any,
        admitted: Sequence[str],
        candidates: dict[str, Candidate],
        first_held: Mapping[str, datetime | None],
        now: datetime,
        claim_for: tuple[str, timedelta] | None,
        rows_of: Mapping[str, Sequence[int]],
    ) -> tuple[list[str], list[OutboxRow]]:
        """Admit ``admitted``: the ones whose job still waits for it when written (a cancel
        may have committed since the round read them: such a job takes no slot and no
        claim, or its slots would never be given back). The jobs admitted, and with
        ``claim_for`` their ranked rows (read due and unclaimed) claimed for the relay."""
        if not admitted:
            return [], []
        won = {
            r.id
            for r in await conn.execute(
                update(jobs)
                .where(jobs.c.id.in_(list(admitted)), awaiting_admission())
                .values(admitted_at=now)
                .returning(jobs.c.id)
            )
        }
        admitted = [job_id for job_id in admitted if job_id in won]
        if not admitted:
            return [], []
        claimed: list[OutboxRow] = []
        released = update(outbox).where(
            # Claimed: only the rows the round ranked (read due and unclaimed).
            outbox.c.job_id.in_(admitted)
            if claim_for is None
            else outbox.c.id.in_([row for job_id in admitted for row in rows_of[job_id]]),
            outbox.c.published_at.is_(None),
            outbox.c.awaiting_admission.is_(True),
        )
        if claim_for is None:
            await conn.execute(released.values(awaiting_admission=False))
        else:
            relay_id, seconds = claim_for
            # Plain columns only: SQLite evaluates expressions in such a RETURNING over the
            # statement's other rows (see ``drivers/sqlite_statements.py``).
            result = await conn.execute(
                released.values(
                    awaiting_admission=False,
                    claimed_by=relay_id,
                    claimed_until=now + seconds,
                    publish_attempts=outbox.c.publish_attempts + 1,
                ).returning(*OUTBOX_CLAIMED)
            )
            claimed = sorted(
                (outbox_row({**r._mapping, "taken_at": now}, r.publish_attempts) for r in result),
                key=lambda row: row.id,
            )
        slots = [
            {"limit_id": limit.limit_id, "job_id": job_id}
            for job_id in admitted
            for limit in candidates[job_id].limits
            if limit.kind in (CONCURRENCY, FAIR, PRIORITY)
        ]
        if slots:
            await conn.execute(insert(job_slots), slots)
        await self.add_events(
            conn,
            "admitted",
            now,
            {
                job_id: _admitted(candidates[job_id].limits)
                for job_id in admitted
                if first_held[job_id] is not None or limiting(candidates[job_id].limits)
            },
        )
        return admitted, claimed


__all__ = ["AdmissionStore", "Admitted", "waiting_jobs", "waiting_ranked"]
