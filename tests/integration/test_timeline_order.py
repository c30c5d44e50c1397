"""A job's timeline is in the order things happened: by time, ties by id (the order they
were written). Rows are not always written in time order: events batched by a worker
(ack_sent) can land after a later one written by another process."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import re
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, insert, select

from jobrelay.admin.explain import console, show_job
from jobrelay.domain.states import JobState
from jobrelay.relay.publisher import Relay
from jobrelay.runtime.wiring import Runtime, utc_now
from jobrelay.storage.engine import create_engine
from jobrelay.storage.records import PendingEvent
from jobrelay.storage.store import Store
from jobrelay.storage.tables import job_events
from jobrelay.transport.base import OutgoingMessage

from .api_fixtures import T0, Clock, api_client, bearer, build_runtime, make_token
from .ops_fixtures import eventually, job_in_state, new_job

pytestmark = pytest.mark.timeout(90)


async def test_events_are_ordered_by_time_then_id(database_url: str) -> None:
    engine = create_engine(database_url)
    try:
        store = Store(engine)
        t0 = utc_now() - timedelta(minutes=5)
        job_id = await job_in_state(store, JobState.QUEUED, t0)
        async with engine.begin() as conn:
            base = int(await conn.scalar(select(func.max(job_events.c.id))) or 0)
            written = [  # (kind, at, id), in the order they are written
                ("late", t0 + timedelta(seconds=3), base + 1),
                ("early", t0 + timedelta(seconds=1), base + 2),
                ("tie_higher_id", t0 + timedelta(seconds=2), base + 20),
                ("tie_lower_id", t0 + timedelta(seconds=2), base + 10),
            ]
            for kind, at, id_ in written:
                await conn.execute(
                    insert(job_events).values(id=id_, job_id=job_id, at=at, kind=kind, detail={})
                )
        kinds = [e.kind for e in await store.events(job_id) if e.at > t0]
        assert kinds == ["early", "tie_lower_id", "tie_higher_id", "late"]
    finally:
        await engine.dispose()


# --- a message's published precedes everything its deliveries wrote (issue 21, item 8) -----

HEALTHY = ["accepted", "published", "claimed", "result_saved", "ack_sent"]


def _explained_kinds(document: dict[str, Any]) -> list[str]:
    return [e["kind"] for e in document["events"]]


async def _every_view(rt: Runtime, job_id: str) -> dict[str, list[str]]:
    """The job's timeline as each reader shows it: the store, the API (account and admin
    events, the explanation the console draws), ``job show`` as JSON and as text."""
    views = {"store": [e.kind for e in await rt.store.events(job_id)]}
    async with api_client(rt) as client:
        account = bearer(await make_token(rt, "acme"))
        admin = bearer(await make_token(rt, None, admin=True))
        for who, token in (("account", account), ("admin", admin)):
            events = await client.get(f"/v1/jobs/{job_id}/events", headers=token)
            assert events.status_code == 200, events.text
            views[f"api events ({who})"] = [e["kind"] for e in events.json()["events"]]
            explain = await client.get(f"/v1/jobs/{job_id}/explain", headers=token)
            assert explain.status_code == 200, explain.text
            views[f"api explain ({who})"] = _explained_kinds(explain.json())
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        assert await show_job(rt.settings, job_id, as_json=True)
    views["job show --json"] = _explained_kinds(json.loads(buffer.getvalue()))
    with console.capture() as text:
        assert await show_job(rt.settings, job_id)
    # The timeline table's rows start with the event's ISO time (the attempts' with a number).
    views["job show"] = re.findall(r"^ *\d{4}-\d\d-\d\dT\S+ +\W +(\w+)", text.get(), re.M)
    return views


async def test_published_precedes_the_claim_a_worker_made_before_the_confirm_came(
    make_pipeline: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race seen on RabbitMQ, forced: the broker hands the message to a worker, which
    claims and finishes the job, before the relay hears the confirm and records ``published``.
    """
    async with make_pipeline() as p:
        publish = p.rt.transport.publish
        confirm = asyncio.Event()

        async def confirmed_late(message: OutgoingMessage) -> None:
            await publish(message)  # the broker has it: a worker can consume it now
            await confirm.wait()  # the confirm reaches the relay only when the test says

        monkeypatch.setattr(p.rt.transport, "publish", confirmed_late)
        await p.start_worker()  # a worker with its own connection: not held
        job_id = await p.submit()
        relaying = asyncio.create_task(Relay(p.rt).relay_once())
        await p.wait_for(job_id, lambda j: j.state is JobState.SUCCEEDED)
        confirm.set()
        assert await asyncio.wait_for(relaying, 30) == 1
        await eventually(lambda: _has(p.rt, job_id, "ack_sent"), what="ack_sent")

        views = await _every_view(p.rt, job_id)
    assert views == {name: HEALTHY for name in views}


async def _has(rt: Runtime, job_id: str, kind: str) -> bool:
    return kind in [e.kind for e in await rt.store.events(job_id)]


async def test_deliveries_follow_their_messages_published_whatever_the_clocks_said(
    database_url: str, tmp_path: Path
) -> None:
    """Skewed clocks: two workers whose host clocks are behind stamp their attempts before
    the relay's ``published`` of the message they consumed. Each delivery names its message
    (``outboxId``), and the timeline puts that message's ``published`` first."""
    rt = build_runtime(database_url, tmp_path, clock=Clock())
    try:
        job_id, _ = await rt.store.submit(await new_job(rt.store), T0)

        def at(seconds: float) -> datetime:
            return T0 + timedelta(seconds=seconds)

        w1, w2 = {"worker": "w1:1:aaaaaa"}, {"worker": "w2:2:bbbbbb"}
        await rt.store.record_events(
            [
                PendingEvent(job_id, "published", at(3), {"outboxId": 41, "relay": "r"}),
                PendingEvent(job_id, "claimed", at(1), {**w1, "attempt": 1, "outboxId": 41}),
                PendingEvent(job_id, "retry_scheduled", at(1.2), {"attempt": 1, "error": "x"}),
                PendingEvent(job_id, "ack_sent", at(1.3), {"attempt": 1}),
                PendingEvent(job_id, "published", at(5), {"outboxId": 42, "relay": "r"}),
                PendingEvent(job_id, "claimed", at(2), {**w2, "attempt": 2, "outboxId": 42}),
                PendingEvent(job_id, "result_saved", at(2.5), {**w2, "attempt": 2}),
                PendingEvent(job_id, "ack_sent", at(2.6), {"attempt": 2}),
                # A redelivery of the first message (same outboxId), acked as a duplicate.
                PendingEvent(job_id, "duplicate_acked", at(2.7), {"outboxId": 41}),
            ]
        )
        views = await _every_view(rt, job_id)
    finally:
        await rt.engine.dispose()
    expected = [
        "accepted",
        "published",
        "claimed",
        "retry_scheduled",
        "ack_sent",
        "published",
        "claimed",
        "result_saved",
        "ack_sent",
        "duplicate_acked",
    ]
    assert views == {name: expected for name in views}
