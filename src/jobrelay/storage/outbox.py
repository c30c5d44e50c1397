"""The outbox as the relay sees it: claim waiting rows, mark them published after a confirm,
or release them with the reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

from sqlalchemy import (
    func,
    insert,
    or_,
    select,
    update,
)

from jobrelay.storage.base import StoreBase
from jobrelay.storage.records import (
    OutboxRow,
)
from jobrelay.storage.tables import (
    job_events,
    outbox,
)


class OutboxStore(StoreBase):
    async def outbox_backlog(self) -> int:
        async with self.reading() as conn:
            n = await conn.scalar(
                select(func.count()).select_from(outbox).where(outbox.c.published_at.is_(None))
            )
        return int(n or 0)

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
        """
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
        return [
            OutboxRow(
                id=r.id,
                job_id=r.job_id,
                destination=r.destination,
                body=r.body.encode(),
                headers=dict(r.headers or {}),
                publish_attempts=r.publish_attempts + 1,
                taken_at=r.taken_at,
            )
            for r in rows
        ]

    async def mark_published(self, relay_id: str, rows: Sequence[OutboxRow]) -> int:
        """Set ``published_at`` for confirmed rows not yet marked; one event each.

        ``published_at`` is when the confirm was recorded (the reconciler judges by it); the
        ``published`` event is stamped ``taken_at``, when the message was sent, so that a
        worker that claimed it before the confirm came back still reads after it.
        """
        if not rows:
            return 0
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
