"""The outbox as the relay sees it: claim waiting rows, mark them published after a confirm,
or release them with the reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

from sqlalchemy import (
    func,
    select,
    update,
)

from jobrelay.storage.base import StoreBase
from jobrelay.storage.delayed import seconds_to_next_due, waiting_due
from jobrelay.storage.records import (
    OutboxRow,
)
from jobrelay.storage.tables import (
    outbox,
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

        On PostgreSQL it is one statement (``drivers.pg_statements.CLAIM_OUTBOX``): no
        transaction to open.
        """
        return await self.driver.claim_outbox(relay_id, limit, claim_for)

    async def mark_published(self, relay_id: str, rows: Sequence[OutboxRow]) -> int:
        """Set ``published_at`` for confirmed rows not yet marked; one event each.

        ``published_at`` is when the confirm was recorded (the reconciler judges by it); the
        ``published`` event is stamped ``taken_at``, when the message was sent, so that a
        worker that claimed it before the confirm came back still reads after it.
        """
        if not rows:
            return 0
        return await self.driver.mark_published(relay_id, rows)

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
