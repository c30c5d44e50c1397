"""The worker's hot path, one statement per guarantee: claim a delivered job, complete it.

What a delivery needs on the happy path is a claim and a completion, each with its event.
``claims`` does them the careful way (read the job, decide, claim guarded on what was read);
here they are one round trip each on PostgreSQL: the guarded ``UPDATE … RETURNING`` and its
``job_events`` row in one data-modifying CTE, in autocommit (no ``BEGIN``/``COMMIT``).

The claim is guarded on exactly the policy's ``ReadyToRun`` (``ClaimsStore.claimable``), so
it needs no earlier read: when it wins, the decision would have been to run; when it loses,
the worker reads the job and lets the policy decide, as before. The fences are the same
ones: nothing here is weaker than the slow path, it only asks fewer questions.

SQLite runs the same writes as separate statements in one transaction (no network there).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import (
    JSON,
    Integer,
    Interval,
    String,
    Text,
    bindparam,
    cast,
    func,
    insert,
    literal,
    literal_column,
    select,
    update,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.ext.asyncio import AsyncConnection

from jobrelay import fastjson
from jobrelay.domain.states import JobState, sources_for
from jobrelay.storage.claims import ClaimsStore
from jobrelay.storage.engine import statement_tx
from jobrelay.storage.records import Claim, Fenced, JobRecord, NewJob, job_record, jsonable
from jobrelay.storage.tables import UTCDateTime, job_events, jobs

_FROM_STATE = "claimed_from_state"
COMPLETABLE = sources_for(JobState.SUCCEEDED)
# What a completion sets besides the state (the names ``complete`` passes in ``values``).
# Not the progress: that is the job's own (``ctx.progress``), kept as it last reported it.
_COMPLETION_VALUES = (
    "result_key",
    "result_meta",
    "lease_owner",
    "lease_expires_at",
    "last_error",
)


def claimed_detail(worker_id: str, detail: dict[str, Any]) -> dict[str, Any]:
    """A ``claimed`` event's detail before the attempt (which the statement adds)."""
    return jsonable({"worker": worker_id, **detail})


def result_saved_detail(
    claim: Claim, result_key: str | None, result_meta: dict[str, Any]
) -> dict[str, Any]:
    """jobrelay's own fields, and the operation's metadata under ``meta`` of its own, so a
    job returning ``{"worker": …}`` cannot overwrite the event's (the worker merges the
    attempt into ``result_meta``; the claim's is the one recorded)."""
    meta = {key: value for key, value in result_meta.items() if key != "attempt"}
    return {
        "resultKey": result_key,
        "worker": claim.worker_id,
        "attempt": claim.attempt,
        "meta": meta,
    }


class HotPathStore(ClaimsStore):
    async def claim_delivered(
        self,
        job_id: str,
        job_type: str,
        worker_id: str,
        now: datetime,
        lease: timedelta,
        **detail: Any,
    ) -> tuple[Claim, JobRecord, JobState] | None:
        """Claim the job a delivery names if it is ready to run: (claim, job, state it left).

        None when it is not (finished, leased, not yet due, attempts used, another type, no
        such job): the caller then reads it and decides what the delivery means.
        """
        async with statement_tx(self.engine, "database") as conn:
            if self.is_postgres:
                row = await self._claim_in_one_statement(
                    conn, job_id, job_type, worker_id, now, lease, detail
                )
            else:
                row = await self._claim_in_steps(
                    conn, job_id, job_type, worker_id, now, lease, detail
                )
        if row is None:
            return None
        job = job_record(row)
        claim = Claim(job_id, job.attempt, worker_id)
        return claim, job, JobState(row._mapping[_FROM_STATE])

    async def _claim_in_one_statement(
        self,
        conn: AsyncConnection,
        job_id: str,
        job_type: str,
        worker_id: str,
        now: datetime,
        lease: timedelta,
        detail: dict[str, Any],
    ) -> Any:
        params = {
            "hp_job_id": job_id,
            "hp_job_type": job_type,
            "hp_worker_id": worker_id,
            "hp_now": now,
            "hp_lease": lease,
            "hp_detail": fastjson.dumps(claimed_detail(worker_id, detail)),
        }
        return (await conn.execute(self._statement("claim", self._build_claim), params)).first()

    def _statement(self, name: str, build: Callable[[], Any]) -> Any:
        """Built once per store: constructing these costs more CPU than running them.

        Their parameters are named ``hp_*``: a parameter named like a column of the UPDATE
        would be taken as a value to SET.

        Not cached under an injected clock: ``now_sql`` is then a value, fixed when built.
        """
        if self._clock is not None:
            return build()
        cache: dict[str, Any] = self.__dict__.setdefault("_hot_statements", {})
        if name not in cache:
            cache[name] = build()
        return cache[name]

    def _build_claim(self) -> Any:
        # The row lock first, so the state it left is the one the UPDATE then changes.
        before = (
            select(jobs.c.id, jobs.c.state.label(_FROM_STATE))
            .where(
                jobs.c.id == bindparam("hp_job_id", type_=String()),
                jobs.c.type == bindparam("hp_job_type", type_=String()),
            )
            .with_for_update(key_share=True)  # FOR NO KEY UPDATE: FK inserts pass
            .cte("before")
        )
        values = self.claim_values(
            bindparam("hp_worker_id", type_=String()),  # type: ignore[arg-type]
            bindparam("hp_now", type_=UTCDateTime()),  # type: ignore[arg-type]
            timedelta(0),
        )
        values["lease_expires_at"] = self.now_sql() + bindparam("hp_lease", type_=Interval())
        claimed = (
            update(jobs)
            .where(jobs.c.id == before.c.id, *self.claimable_delivered())
            .values(**values)
            .returning(*jobs.c, before.c[_FROM_STATE])
            .cte("claimed")
        )
        event_detail = cast(
            cast(bindparam("hp_detail", type_=Text()), JSONB).op("||")(
                func.jsonb_build_object("attempt", claimed.c.attempt)
            ),
            JSON,
        )
        event = (
            insert(job_events)
            .from_select(
                ["job_id", "at", "kind", "detail"],
                select(
                    claimed.c.id,
                    bindparam("hp_now", type_=UTCDateTime()),
                    literal_column("'claimed'"),
                    event_detail,
                ),
            )
            .cte("event")
        )
        return select(claimed).add_cte(event)

    async def _claim_in_steps(
        self,
        conn: AsyncConnection,
        job_id: str,
        job_type: str,
        worker_id: str,
        now: datetime,
        lease: timedelta,
        detail: dict[str, Any],
    ) -> Any:
        state = await conn.scalar(
            select(jobs.c.state).where(jobs.c.id == job_id, jobs.c.type == job_type)
        )
        if state is None:
            return None
        row = (
            await conn.execute(
                update(jobs)
                .where(jobs.c.id == job_id, *self.claimable_delivered())
                .values(**self.claim_values(worker_id, now, lease))
                .returning(*jobs.c, literal(state).label(_FROM_STATE))
            )
        ).first()
        if row is not None:
            await self.add_event(
                conn, job_id, "claimed", now, worker=worker_id, attempt=row.attempt, **detail
            )
        return row

    async def complete(
        self,
        claim: Claim,
        result_key: str | None,
        result_meta: dict[str, Any],
        now: datetime,
        follow_ups: Sequence[NewJob] = (),
        publish: Callable[[], Awaitable[None]] | None = None,
    ) -> Fenced:
        """running -> succeeded with its result key, BEFORE the delivery is acked.

        Fenced on the claim. ``publish`` makes the staged result visible under its key while
        the guarded UPDATE holds the job's row lock (PostgreSQL) or the write lock (SQLite),
        and before the commit: a stale attempt can never pass the guard, so it can never
        replace the object the winning attempt committed. A publish that fails rolls the
        whole completion back.

        ``follow_ups`` (a notification of this success) are created in the SAME transaction,
        each with its outbox row and ``accepted`` event: no success without its follow-up,
        and, their ids being derived from this job's, never a second one.

        With neither, the completion is one statement in autocommit: one round trip.
        """
        values = {
            "result_key": result_key,
            "result_meta": result_meta,
            "lease_owner": None,
            "lease_expires_at": None,
            "last_error": None,
        }
        event = result_saved_detail(claim, result_key, result_meta)
        in_one = publish is None and not follow_ups
        opened = statement_tx(self.engine, "database") if in_one else self.writing()
        async with opened as conn:
            if not await self._completed(conn, claim, now, values, event):
                return await self.current(conn, claim.job_id)
            if publish is not None:
                await publish()
            for follow_up in follow_ups:
                await self.add_follow_up(conn, claim.job_id, follow_up, now)
        if follow_ups:
            self.wake_relays()
        return Fenced(True)

    async def _completed(
        self,
        conn: AsyncConnection,
        claim: Claim,
        now: datetime,
        values: dict[str, Any],
        event_detail: dict[str, Any],
    ) -> bool:
        """The guarded running -> succeeded and its ``result_saved`` event; True if it won."""
        if not self.is_postgres:
            done = (
                update(jobs)
                .where(jobs.c.id == claim.job_id, self.state_in(COMPLETABLE), *self.fenced(claim))
                .values(state=JobState.SUCCEEDED.value, updated_at=now, **values)
            )
            if (await conn.execute(done)).rowcount != 1:
                return False
            await self.add_event(conn, claim.job_id, "result_saved", now, **event_detail)
            return True
        params = {
            **{f"hp_{name}": value for name, value in values.items()},
            "hp_job_id": claim.job_id,
            "hp_attempt": claim.attempt,
            "hp_worker_id": claim.worker_id,
            "hp_now": now,
            "hp_detail": jsonable(event_detail),
        }
        won = await conn.scalar(self._statement("complete", self._build_complete), params)
        return bool(won == 1)

    def _build_complete(self) -> Any:
        token = Claim(
            bindparam("hp_job_id", type_=String()),  # type: ignore[arg-type]
            bindparam("hp_attempt", type_=Integer()),  # type: ignore[arg-type]
            bindparam("hp_worker_id", type_=String()),  # type: ignore[arg-type]
        )
        done = (
            update(jobs)
            .where(jobs.c.id == token.job_id, self.state_in(COMPLETABLE), *self.fenced(token))
            .values(
                state=JobState.SUCCEEDED.value,
                updated_at=bindparam("hp_now", type_=UTCDateTime()),
                **{n: bindparam(f"hp_{n}", type_=jobs.c[n].type) for n in _COMPLETION_VALUES},
            )
            .returning(jobs.c.id)
            .cte("done")
        )
        event = (
            insert(job_events)
            .from_select(
                ["job_id", "at", "kind", "detail"],
                select(
                    done.c.id,
                    bindparam("hp_now", type_=UTCDateTime()),
                    literal_column("'result_saved'"),
                    bindparam("hp_detail", type_=JSON()),
                ),
            )
            .cte("event")
        )
        return select(func.count()).select_from(done).add_cte(event)
