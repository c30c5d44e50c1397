"""At INFO a worker logs its settles as one line per batch, not a line per job
(worker/timeline.py): how many acked, rejected and lost, the first and last job; the last
batch is logged when the writer closes, and every event still reaches the store."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from datetime import UTC, datetime

import pytest

from jobrelay.errors import StoreDataError
from jobrelay.storage.records import PendingEvent
from jobrelay.worker import timeline
from jobrelay.worker.timeline import TimelineWriter

NOW = datetime(2026, 1, 2, tzinfo=UTC)


class Events:
    def __init__(self) -> None:
        self.written: list[PendingEvent] = []

    async def record_events(self, events: Sequence[PendingEvent]) -> None:
        self.written.extend(events)


def _summaries(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "event", None) == "settled"]


def _writer(store: Events) -> TimelineWriter:
    return TimelineWriter(store)  # type: ignore[arg-type]  # the one method it calls


async def test_one_info_line_counts_the_settles_of_a_batch(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    store = Events()
    writer = _writer(store)
    writer.start_batching()
    kinds = ["ack_sent", "ack_sent", "rejected", "ack_sent", "settle_lost"]
    for n, kind in enumerate(kinds):
        await writer.record(f"job-{n}", kind, NOW, attempt=1)
    assert not _summaries(caplog)  # the batch's second has not ended
    writer.log_summary()
    [line] = _summaries(caplog)
    assert line.levelno == logging.INFO and line.name == "jobrelay.worker"
    fields = {k: getattr(line, k) for k in ("count", "acked", "rejected", "settleLost")}
    assert fields == {"count": 5, "acked": 3, "rejected": 1, "settleLost": 1}
    assert (line.firstJobId, line.lastJobId) == ("job-0", "job-4")
    assert line.getMessage() == "settled 5 deliveries: 3 acked, 1 rejected, 1 lost"

    await writer.record("job-5", "ack_sent", NOW, attempt=2)
    await writer.close()  # the last batch is logged, its events written
    assert [r.count for r in _summaries(caplog)] == [5, 1]
    assert _summaries(caplog)[-1].firstJobId == "job-5"
    assert [(e.job_id, e.kind) for e in store.written] == [
        *((f"job-{n}", kind) for n, kind in enumerate(kinds)),
        ("job-5", "ack_sent"),
    ]
    writer.log_summary()  # nothing settled since: no line
    assert len(_summaries(caplog)) == 2


async def test_the_line_comes_when_the_batch_window_ends(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.INFO)
    monkeypatch.setattr(timeline, "SUMMARY_SECONDS", 0.01)
    writer = _writer(Events())
    logged = asyncio.Event()

    class Seen(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if getattr(record, "event", None) == "settled":
                logged.set()

    seen = Seen()
    timeline.progress_log.addHandler(seen)
    try:
        await writer.record("job-1", "ack_sent", NOW, attempt=1)
        async with asyncio.timeout(10):
            await logged.wait()  # the timer's line, with nothing else calling for it
    finally:
        timeline.progress_log.removeHandler(seen)
    [line] = _summaries(caplog)
    assert line.acked == 1
    await writer.close()
    assert len(_summaries(caplog)) == 1


async def test_settles_taken_by_a_claim_are_not_written_again_and_given_back_are() -> None:
    """A busy worker's settles ride on its next claim (``take``): the writer's own statement
    then has nothing to write. A claim that failed gives them back: written by the writer's
    own statement, in their order, and not taken by the next claim (a bad one must not fail
    claims over and over)."""
    store = Events()
    writer = _writer(store)
    writer.start_batching()
    await writer.record("job-0", "ack_sent", NOW)
    await writer.record("job-1", "ack_sent", NOW)
    taken = writer.take()
    assert [e.job_id for e in taken] == ["job-0", "job-1"]
    await writer.record("job-2", "ack_sent", NOW)
    writer.give_back(taken)
    assert writer.take() == []  # given back: the writer's own, not the next claim's
    await writer.close()
    assert [e.job_id for e in store.written] == ["job-0", "job-1", "job-2"]

    await writer.record("job-3", "ack_sent", NOW)  # written at once: not batching any more
    writer.start_batching()
    await writer.record("job-4", "ack_sent", NOW)
    assert [e.job_id for e in writer.take()] == ["job-4"]  # written once, with the claim
    await writer.close()
    assert [e.job_id for e in store.written] == ["job-0", "job-1", "job-2", "job-3"]


class Held(Events):
    """A store whose writes wait for ``release``, to give events back during one."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()
        self.writing = asyncio.Event()
        self.wrote = asyncio.Event()

    async def record_events(self, events: Sequence[PendingEvent]) -> None:
        self.writing.set()
        await self.release.wait()
        await super().record_events(events)
        self.wrote.set()


async def test_events_given_back_during_a_write_wait_for_a_write_that_holds_them() -> None:
    """Old code: any write that succeeded let the next claim take the given-back events
    again, here the one already under way when they came back (review of stop 52)."""
    store = Held()
    writer = TimelineWriter(store, window=0.5)  # type: ignore[arg-type]  # the one method
    writer.start_batching()
    await writer.record("job-0", "ack_sent", NOW)
    await store.writing.wait()  # job-0's write is under way
    await writer.record("job-1", "ack_sent", NOW)
    taken = writer.take()
    assert [e.job_id for e in taken] == ["job-1"]
    writer.give_back(taken)  # its claim failed
    store.release.set()
    await store.wrote.wait()  # job-0 written; the writer waits its window before job-1
    assert [e.job_id for e in store.written] == ["job-0"]
    assert writer.take() == []  # job-1 is the writer's own: no claim takes it again
    await writer.close()
    assert [e.job_id for e in store.written] == ["job-0", "job-1"]


class Refusing(Events):
    """A database that refuses any statement holding an event of ``job-bad`` (its job
    deleted by retention meanwhile, say)."""

    async def record_events(self, events: Sequence[PendingEvent]) -> None:
        if any(e.job_id == "job-bad" for e in events):
            raise StoreDataError("insert or update on table job_events violates a foreign key")
        await super().record_events(events)


async def test_an_event_the_database_refuses_is_dropped_alone_and_holds_back_no_other(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Old code: the writer retried the refused batch for good, each later event joining
    it, so one refused event ended the worker's timeline (its close gave up on them all)."""
    store = Refusing()
    writer = _writer(store)
    writer.start_batching()
    for job in ("job-0", "job-bad", "job-1"):
        await writer.record(job, "ack_sent", NOW)
    await writer.close(timeout=2.0)
    assert [e.job_id for e in store.written] == ["job-0", "job-1"]
    dropped = [r for r in caplog.records if getattr(r, "event", None) == "event_dropped"]
    assert [(r.jobId, r.kind) for r in dropped] == [("job-bad", "ack_sent")]
