"""The relay's sliding window (issue 23, item 5).

A relay claims the next batch while the confirms of earlier batches are pending, up to
``JOBRELAY_RELAY_WINDOW`` rows in flight, and no more. Confirms are held here by a publish
that waits on an event the test sets, so nothing depends on the broker being slow. Each row
is still published once and marked once, with one ``published`` event. On SQLite + the local
transport and on PostgreSQL + RabbitMQ (``backend``).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest
from sqlalchemy import func, select

from jobrelay.relay.publisher import Relay
from jobrelay.storage.tables import job_events, outbox
from jobrelay.transport.base import OutgoingMessage

from .ops_fixtures import eventually

pytestmark = pytest.mark.timeout(120)

JOBS = 50
BATCH = 10
WINDOW = 30


async def test_the_relay_claims_while_confirms_are_pending_up_to_its_window(
    make_pipeline: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with make_pipeline(relay_batch=str(BATCH), relay_window=str(WINDOW)) as p:
        rt = p.rt
        confirms = asyncio.Event()
        pending = 0
        most = 0
        sent: list[str | None] = []
        publish = rt.transport.publish

        async def held(message: OutgoingMessage) -> None:
            nonlocal pending, most
            pending += 1
            most = max(most, pending)
            try:
                await confirms.wait()
                await publish(message)
                sent.append(message.message_id)
            finally:
                pending -= 1

        monkeypatch.setattr(rt.transport, "publish", held)
        for i in range(JOBS):
            await p.submit(key=f"window-{i}")
        relay = Relay(rt)
        stop = asyncio.Event()
        task = asyncio.create_task(relay.run(stop))
        try:

            async def window_full() -> bool:
                return pending == WINDOW

            await eventually(window_full, what=f"{WINDOW} publishes pending at once")
            async with rt.engine.connect() as conn:
                claimed = await conn.scalar(
                    select(func.count())
                    .select_from(outbox)
                    .where(outbox.c.claimed_by == relay.relay_id, outbox.c.published_at.is_(None))
                )
            assert claimed == WINDOW  # three batches claimed, none confirmed, none beyond

            confirms.set()

            async def all_marked() -> bool:
                async with rt.engine.connect() as conn:
                    waiting = await conn.scalar(
                        select(func.count())
                        .select_from(outbox)
                        .where(outbox.c.published_at.is_(None))
                    )
                return waiting == 0

            await eventually(all_marked, what="every row marked published")
        finally:
            stop.set()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(task, 30)
        assert most == WINDOW
        assert len(sent) == JOBS and len(set(sent)) == JOBS  # each row published once
        async with rt.engine.connect() as conn:
            events = (
                await conn.execute(
                    select(job_events.c.job_id, func.count())
                    .where(job_events.c.kind == "published")
                    .group_by(job_events.c.job_id)
                )
            ).all()
        assert len(events) == JOBS and {n for _, n in events} == {1}
