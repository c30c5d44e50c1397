"""The hot path for many deliveries at once: one statement claims (or completes) a batch.

The same guards as ``hot_path``, row by row, over arrays (``unnest``; ``= ANY`` needs no
statement per batch size, so the prepared statement is the same for 1 and for 100 jobs).
Each job in a batch wins or loses on its own: a lost claim goes to the read-and-decide path,
a lost completion reads what holds the job now.

SQLite has no arrays: there a batch is ONE write transaction (one ``BEGIN IMMEDIATE``, one
commit; at ``synchronous=NORMAL`` in WAL no fsync per commit, as for every write there), with
the same guards (``claims``), the same events and the same answers. What costs there is the
Python per statement, so a batch of claims is three statements and a batch of completions
one per job and one for all their events.

Rows are locked in id order (``ORDER BY id FOR NO KEY UPDATE``): two batches never wait on
each other in a cycle, and the key-share locks of event and outbox inserts (their foreign
keys) never conflict with them (a plain ``FOR UPDATE`` would, and deadlocked the relay).

Each row is prepared alone (``storable.outcome_json``): a row that cannot be stored fails
the statement before it is sent, with a ``StoreDataError`` the worker's batcher answers by
sending each request alone, so only that job fails.

A batch is one commit: nothing of it is acked before it returns, and a crash after the commit
but before the acks leaves redeliveries that find the jobs finished and are acked as
duplicates — commit-before-ack per job, batched.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta

from sqlalchemy import (
    ARRAY,
    Column,
    Integer,
    Interval,
    String,
    Text,
    bindparam,
    literal_column,
    text,
    update,
)

from jobrelay import fastjson
from jobrelay.domain.policy import RETRY_SLACK
from jobrelay.domain.states import JobState
from jobrelay.storage.base import StoreBase
from jobrelay.storage.claims import claimable_delivered, fenced, guard_sql, holds
from jobrelay.storage.hot_path import COMPLETABLE, claimed_detail, result_saved_detail
from jobrelay.storage.pg_hot import HotStatement
from jobrelay.storage.records import Claim, JobRecord, Renewed, job_record, jsonable
from jobrelay.storage.sqlite_batches import ClaimRequest, CompleteRequest, SqliteBatches
from jobrelay.storage.storable import outcome_json
from jobrelay.storage.tables import UTCDateTime, jobs

_RUNNING = JobState.RUNNING.value

# The guards are the policy's, from ``claims`` (the one place that states them), written
# over the statements' own columns: the store's clock (``clock.now``) and the request arrays.
_CLAIMABLE = guard_sql(
    claimable_delivered(
        literal_column("clock.now", UTCDateTime()),
        literal_column("clock.now + :b_slack", UTCDateTime()),
    )
)
_COMPLETE_FENCE = guard_sql(
    [
        StoreBase.state_in(COMPLETABLE),
        *fenced(
            Claim(
                literal_column("req.id"),  # type: ignore[arg-type]
                literal_column("req.attempt"),  # type: ignore[arg-type]
                literal_column("req.worker"),  # type: ignore[arg-type]
            )
        ),
    ]
)

_CLAIM_MANY = text(
    f"""
WITH clock AS (SELECT COALESCE(:b_clock, now()) AS now),
req AS (
    SELECT * FROM unnest(CAST(:b_ids AS text[]), CAST(:b_types AS text[]),
                         CAST(:b_workers AS text[]), CAST(:b_details AS text[]))
        AS r(id, type, worker, detail)
),
before AS (
    SELECT j.id, j.state AS from_state, req.worker, req.detail
    FROM jobs j JOIN req ON j.id = req.id AND j.type = req.type
    ORDER BY j.id
    FOR NO KEY UPDATE OF j
),
claimed AS (
    UPDATE jobs SET
        state = '{_RUNNING}', updated_at = :b_now, attempt = jobs.attempt + 1,
        lease_owner = before.worker, lease_expires_at = clock.now + :b_lease,
        next_attempt_at = NULL, progress_done = NULL, progress_total = NULL
    FROM before, clock
    WHERE jobs.id = before.id AND {_CLAIMABLE}
    RETURNING jobs.*, before.from_state AS claimed_from_state, before.detail AS claim_detail
),
event AS (
    INSERT INTO job_events (job_id, at, kind, detail)
    SELECT id, :b_now, 'claimed',
           CAST(CAST(claim_detail AS jsonb) || jsonb_build_object('attempt', attempt) AS json)
    FROM claimed
)
SELECT * FROM claimed
"""
).bindparams(
    bindparam("b_ids", type_=ARRAY(String())),
    bindparam("b_types", type_=ARRAY(String())),
    bindparam("b_workers", type_=ARRAY(String())),
    bindparam("b_details", type_=ARRAY(Text())),
    bindparam("b_now", type_=UTCDateTime()),
    bindparam("b_lease", type_=Interval()),
    bindparam("b_slack", type_=Interval()),
    bindparam("b_clock", type_=UTCDateTime()),
)
_CLAIM_MANY_COLUMNS = HotStatement(
    _CLAIM_MANY.columns(
        *(Column(c.name, c.type) for c in jobs.c),
        Column("claimed_from_state", String()),
        Column("claim_detail", Text()),
    )
)

_COMPLETE_MANY = HotStatement(
    text(
        f"""
WITH req AS (
    SELECT * FROM unnest(CAST(:b_ids AS text[]), CAST(:b_attempts AS integer[]),
                         CAST(:b_workers AS text[]), CAST(:b_keys AS text[]),
                         CAST(:b_metas AS text[]), CAST(:b_details AS text[]))
        AS r(id, attempt, worker, result_key, meta, detail)
),
locked AS (
    SELECT j.id FROM jobs j JOIN req ON j.id = req.id ORDER BY j.id FOR NO KEY UPDATE OF j
),
done AS (
    UPDATE jobs SET
        state = '{JobState.SUCCEEDED.value}', updated_at = :b_now,
        result_key = req.result_key, result_meta = CAST(req.meta AS json),
        lease_owner = NULL, lease_expires_at = NULL, last_error = NULL
    FROM req JOIN locked ON locked.id = req.id
    WHERE jobs.id = req.id AND {_COMPLETE_FENCE}
    RETURNING jobs.id, req.detail
),
event AS (
    INSERT INTO job_events (job_id, at, kind, detail)
    SELECT id, :b_now, 'result_saved', CAST(detail AS json) FROM done
)
SELECT id FROM done
"""
    ).bindparams(
        bindparam("b_ids", type_=ARRAY(String())),
        bindparam("b_attempts", type_=ARRAY(Integer())),
        bindparam("b_workers", type_=ARRAY(String())),
        bindparam("b_keys", type_=ARRAY(Text())),
        bindparam("b_metas", type_=ARRAY(Text())),
        bindparam("b_details", type_=ARRAY(Text())),
        bindparam("b_now", type_=UTCDateTime()),
    )
)

# A renewal is no outcome: guarded on the claim holding the job (``claims.holds``), and it
# answers, per claim, whether an operator asked to cancel it (``storage.cancels``).
_RENEW_HOLDS = guard_sql(
    holds(
        Claim(
            literal_column("req.id"),  # type: ignore[arg-type]
            literal_column("req.attempt"),  # type: ignore[arg-type]
            literal_column("req.worker"),  # type: ignore[arg-type]
        )
    )
)

# Every running claim of a worker renewed at once (its one lease renewer), fenced per row as
# a completion is, rows locked in id order as the completions lock them. A row another
# transaction holds locked (its own completion, an upload once made under it) is SKIPPED,
# never waited on: one locked row must not hold up the renewal of its neighbours. A skipped
# row whose last committed state still shows the claim holding it is answered ``skipped``
# (not renewed, not lost: nobody can take it over while the lock is held either).
_RENEW_MANY = HotStatement(
    text(
        f"""
WITH clock AS (SELECT COALESCE(:l_clock, now()) AS now),
req AS (
    SELECT * FROM unnest(CAST(:l_ids AS text[]), CAST(:l_attempts AS integer[]),
                         CAST(:l_workers AS text[]))
        AS r(id, attempt, worker)
),
locked AS (
    SELECT j.id FROM jobs j JOIN req ON j.id = req.id
    ORDER BY j.id FOR NO KEY UPDATE OF j SKIP LOCKED
),
renewed AS (
    UPDATE jobs SET lease_expires_at = clock.now + :l_lease, updated_at = :l_now
    FROM req JOIN locked ON locked.id = req.id, clock
    WHERE jobs.id = req.id AND {_RENEW_HOLDS}
    RETURNING jobs.id, req.attempt, jobs.cancel_requested_at IS NOT NULL AS cancel_requested
)
SELECT id, attempt, cancel_requested, false AS skipped FROM renewed
UNION ALL
SELECT jobs.id, req.attempt, false, true FROM jobs JOIN req ON jobs.id = req.id
WHERE {_RENEW_HOLDS} AND NOT EXISTS (SELECT 1 FROM locked WHERE locked.id = req.id)
"""
    ).bindparams(
        bindparam("l_ids", type_=ARRAY(String())),
        bindparam("l_attempts", type_=ARRAY(Integer())),
        bindparam("l_workers", type_=ARRAY(String())),
        bindparam("l_lease", type_=Interval()),
        bindparam("l_now", type_=UTCDateTime()),
        bindparam("l_clock", type_=UTCDateTime()),
    )
)


class BatchStore(SqliteBatches):
    async def claim_many(
        self, requests: Sequence[ClaimRequest], now: datetime, lease: timedelta
    ) -> list[tuple[Claim, JobRecord, JobState] | None]:
        """``claim_delivered`` for many distinct jobs in one statement, in request order."""
        if not self.is_postgres:
            return await self._claim_many_sqlite(requests, now, lease)
        params = {
            "b_ids": [r.job_id for r in requests],
            "b_types": [r.job_type for r in requests],
            "b_workers": [r.worker_id for r in requests],
            "b_details": [fastjson.dumps(claimed_detail(r.worker_id, r.detail)) for r in requests],
            "b_now": now,
            "b_lease": lease,
            "b_slack": RETRY_SLACK,
            # The database's clock; a store given a clock (tests) judges by that one.
            "b_clock": self._clock() if self._clock is not None else None,
        }
        rows = await self.hot_rows(_CLAIM_MANY_COLUMNS, params)
        won = {row["id"]: row for row in rows}
        results: list[tuple[Claim, JobRecord, JobState] | None] = []
        for request in requests:
            row = won.get(request.job_id)
            if row is None:
                results.append(None)
                continue
            job = job_record(row)
            claim = Claim(job.id, job.attempt, request.worker_id)
            results.append((claim, job, JobState(row["claimed_from_state"])))
        return results

    async def complete_many(self, requests: Sequence[CompleteRequest], now: datetime) -> set[str]:
        """Fenced completions (nothing to publish, no follow-ups) in one statement; the ids
        of the jobs whose completion won."""
        if not self.is_postgres:
            return await self._complete_many_sqlite(requests, now)
        params = {
            "b_ids": [r.claim.job_id for r in requests],
            "b_attempts": [r.claim.attempt for r in requests],
            "b_workers": [r.claim.worker_id for r in requests],
            "b_keys": [r.result_key for r in requests],
            "b_metas": [outcome_json(r.result_key, r.result_meta) for r in requests],
            "b_details": [
                fastjson.dumps(jsonable(result_saved_detail(r.claim, r.result_key, r.result_meta)))
                for r in requests
            ],
            "b_now": now,
        }
        return {row["id"] for row in await self.hot_rows(_COMPLETE_MANY, params)}

    async def renew_leases(
        self, claims: Sequence[Claim], lease: timedelta, now: datetime
    ) -> Renewed:
        """``renew_lease`` for many claims in one statement (one transaction on SQLite):
        the claims that still hold their job, each lease now ending at the store's clock
        + ``lease``, which of them an operator has asked to cancel, and (PostgreSQL) which
        were skipped because another transaction held their row locked."""
        if not claims:
            return Renewed()
        if not self.is_postgres:
            held: list[Claim] = []
            cancels: list[Claim] = []
            async with self.writing() as conn:
                for claim in claims:
                    row = (
                        await conn.execute(
                            update(jobs)
                            .where(jobs.c.id == claim.job_id, *holds(claim))
                            .values(lease_expires_at=self.now_sql(lease), updated_at=now)
                            .returning(jobs.c.cancel_requested_at)
                        )
                    ).first()
                    if row is not None:
                        held.append(claim)
                        if row.cancel_requested_at is not None:
                            cancels.append(claim)
            return Renewed(held, cancels)
        params = {
            "l_ids": [c.job_id for c in claims],
            "l_attempts": [c.attempt for c in claims],
            "l_workers": [c.worker_id for c in claims],
            "l_lease": lease,
            "l_now": now,
            "l_clock": self._clock() if self._clock is not None else None,
        }
        rows = await self.hot_rows(_RENEW_MANY, params)
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


__all__ = ["BatchStore", "ClaimRequest", "CompleteRequest"]
