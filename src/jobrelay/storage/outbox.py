"""The outbox as the relay sees it: claim waiting rows, mark them published after a confirm,
or release them with the reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from sqlalchemy import (
    ARRAY,
    BigInteger,
    Column,
    Integer,
    Interval,
    String,
    bindparam,
    func,
    insert,
    literal_column,
    or_,
    select,
    text,
    update,
)

from jobrelay.storage.base import StoreBase
from jobrelay.storage.claims import guard_sql
from jobrelay.storage.delayed import outbox_due, seconds_to_next_due, waiting_due
from jobrelay.storage.pg_hot import HotStatement
from jobrelay.storage.records import (
    OutboxRow,
)
from jobrelay.storage.tables import (
    UTCDateTime,
    job_events,
    outbox,
)

# PostgreSQL: the relay's two statements, each its own transaction (``pg_hot``). The
# claim: rows waiting and not claimed by a live relay, skipped when another claim holds
# them, taken for ``o_claim_for`` by the store's clock, which is also their ``taken_at``.
# Only rows due by then (``delayed.outbox_due``: a delayed job's row is held until its time).
_CLAIM_OUTBOX = HotStatement(
    text(
        f"""
WITH clock AS (SELECT COALESCE(:o_clock, now()) AS now),
picked AS (
    SELECT outbox.id FROM outbox, clock
    WHERE outbox.published_at IS NULL
      AND (outbox.claimed_until IS NULL OR outbox.claimed_until < clock.now)
      AND ({guard_sql([outbox_due(literal_column("clock.now"))])})
    ORDER BY outbox.id
    LIMIT :o_limit
    FOR UPDATE OF outbox SKIP LOCKED
)
UPDATE outbox SET
    claimed_by = :o_relay, claimed_until = clock.now + :o_claim_for,
    publish_attempts = outbox.publish_attempts + 1
FROM picked, clock
WHERE outbox.id = picked.id
RETURNING outbox.id, outbox.job_id, outbox.destination, outbox.body, outbox.headers,
          outbox.publish_attempts, clock.now AS taken_at
"""
    )
    .bindparams(
        bindparam("o_relay", type_=String()),
        bindparam("o_limit", type_=Integer()),
        bindparam("o_claim_for", type_=Interval()),
        bindparam("o_clock", type_=UTCDateTime()),
    )
    .columns(
        outbox.c.id,
        outbox.c.job_id,
        outbox.c.destination,
        outbox.c.body,
        outbox.c.headers,
        outbox.c.publish_attempts,
        Column("taken_at", UTCDateTime()),
    )
)
# The mark: confirmed rows not yet marked, and a ``published`` event each, stamped with the
# instant the row was taken (see ``mark_published``).
_MARK_PUBLISHED = HotStatement(
    text(
        """
WITH req AS (
    SELECT * FROM unnest(CAST(:m_ids AS bigint[]), CAST(:m_taken AS timestamptz[]))
        AS r(id, taken_at)
),
marked AS (
    UPDATE outbox SET
        published_at = COALESCE(:m_clock, now()), claimed_until = NULL, last_error = NULL
    FROM req
    WHERE outbox.id = req.id AND outbox.published_at IS NULL
    RETURNING outbox.id, outbox.job_id, outbox.destination, req.taken_at
),
event AS (
    INSERT INTO job_events (job_id, at, kind, detail)
    SELECT job_id, taken_at, 'published',
           json_build_object('destination', destination, 'outboxId', id,
                             'relay', CAST(:m_relay AS text))
    FROM marked
)
SELECT count(*) AS marked FROM marked
"""
    ).bindparams(
        bindparam("m_ids", type_=ARRAY(BigInteger())),
        bindparam("m_taken", type_=ARRAY(UTCDateTime())),
        bindparam("m_relay", type_=String()),
        bindparam("m_clock", type_=UTCDateTime()),
    )
)


def _outbox_row(r: Any, publish_attempts: int) -> OutboxRow:
    return OutboxRow(
        id=r["id"],
        job_id=r["job_id"],
        destination=r["destination"],
        body=r["body"].encode(),
        headers=dict(r["headers"] or {}),
        publish_attempts=publish_attempts,
        taken_at=r["taken_at"],
    )


class OutboxStore(StoreBase):
    async def outbox_backlog(self) -> int:
        async with self.reading() as conn:
            n = await conn.scalar(
                select(func.count()).select_from(outbox).where(waiting_due(self.now_sql()))
            )
        return int(n or 0)

    async def seconds_to_next_due(self) -> float | None:
        """Seconds until the earliest held row (a delayed job's) falls due; None: none held.

        The relay sleeps no longer than that when it has nothing else to do, so a job due in
        2 s is published about 2 s later, not at the next poll after."""
        async with self.reading() as conn:
            return await seconds_to_next_due(conn, self.now_sql())

    async def claim_outbox(
        self, relay_id: str, limit: int, claim_for: timedelta
    ) -> list[OutboxRow]:
        """Take up to ``limit`` waiting rows for ``claim_for``, in a short transaction.

        The claim is a lease too, judged and set by the store's clock, so a relay whose host
        clock runs ahead cannot take rows another relay still owns.

        ``SKIP LOCKED`` lets several relays claim side by side; the claim itself is a column,
        so the relay can publish with no transaction open. Order is by id only as a fairness
        hint: a lower id may commit after a higher one, and is still found later because the
        filter is on per-row state, never on an id watermark.

        Each row carries the claim's instant by the store's clock (``taken_at``): the relay
        sends right after, so it is the hand-off's time, and it precedes any claim a worker
        makes of the message (the confirm, and the mark, may come after that claim).

        On PostgreSQL it is one statement (``_CLAIM_OUTBOX``): no transaction to open.
        """
        if self.is_postgres:
            params = {
                "o_relay": relay_id,
                "o_limit": limit,
                "o_claim_for": claim_for,
                "o_clock": self._clock() if self._clock is not None else None,
            }
            claimed = sorted(await self.hot_rows(_CLAIM_OUTBOX, params), key=lambda r: r["id"])
            return [_outbox_row(r, r["publish_attempts"]) for r in claimed]
        async with self.writing() as conn:
            rows = (
                await conn.execute(
                    select(outbox, self.now_sql().label("taken_at"))
                    .where(
                        outbox.c.published_at.is_(None),
                        or_(
                            outbox.c.claimed_until.is_(None),
                            outbox.c.claimed_until < self.now_sql(),
                        ),
                        outbox_due(self.now_sql()),
                    )
                    .order_by(outbox.c.id)
                    .limit(limit)
                    .with_for_update(skip_locked=True)
                )
            ).all()
            if not rows:
                return []
            ids = [r.id for r in rows]
            await conn.execute(
                update(outbox)
                .where(outbox.c.id.in_(ids))
                .values(
                    claimed_by=relay_id,
                    claimed_until=self.now_sql(claim_for),
                    publish_attempts=outbox.c.publish_attempts + 1,
                )
            )
        return [_outbox_row(r._mapping, r.publish_attempts + 1) for r in rows]

    async def mark_published(self, relay_id: str, rows: Sequence[OutboxRow]) -> int:
        """Set ``published_at`` for confirmed rows not yet marked; one event each.

        ``published_at`` is when the confirm was recorded (the reconciler judges by it); the
        ``published`` event is stamped ``taken_at``, when the message was sent, so that a
        worker that claimed it before the confirm came back still reads after it.
        """
        if not rows:
            return 0
        if self.is_postgres:
            params = {
                "m_ids": [r.id for r in rows],
                "m_taken": [r.taken_at for r in rows],
                "m_relay": relay_id,
                "m_clock": self._clock() if self._clock is not None else None,
            }
            [marked_count] = await self.hot_rows(_MARK_PUBLISHED, params)
            return int(marked_count["marked"])
        taken = {r.id: r.taken_at for r in rows}
        async with self.writing() as conn:
            done = await conn.execute(
                update(outbox)
                .where(
                    outbox.c.id.in_([r.id for r in rows]),
                    outbox.c.published_at.is_(None),
                )
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

    async def release_outbox(self, row: OutboxRow, error: str, backoff: timedelta) -> None:
        """A publish failed (nack, return, timeout): keep the row waiting, record why.

        The row stays claimed for ``backoff`` (by the store's clock) so an unroutable row backs
        off instead of being retried in a hot loop.
        """
        async with self.writing() as conn:
            await conn.execute(
                update(outbox)
                .where(outbox.c.id == row.id, outbox.c.published_at.is_(None))
                .values(
                    claimed_until=self.now_sql(backoff), claimed_by=None, last_error=error[:2000]
                )
            )
