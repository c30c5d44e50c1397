"""The check route (a)-(g), on SQLite + the local transport and on PostgreSQL + RabbitMQ.

Each scenario runs the shipped relay and worker in this process (see pipeline.py) and then
checks its invariants against the database, the results directory and the broker.
"""

from __future__ import annotations

import asyncio
import csv
import io
import time
from pathlib import Path
from typing import Any

import pytest

from jobrelay.domain.messages import JobMessage
from jobrelay.domain.states import JobState
from jobrelay.exports import ledger
from jobrelay.relay.publisher import Relay
from jobrelay.storage.tables import outbox
from jobrelay.transport.base import OutgoingMessage

from .pipeline import Pipeline

pytestmark = pytest.mark.timeout(90)


# ``backend`` (SQLite + local, PostgreSQL + RabbitMQ) and ``make_pipeline`` come from
# tests/integration/conftest.py.


def result_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def done(job: Any) -> bool:
    return bool(job.state in (JobState.SUCCEEDED, JobState.QUARANTINED))


async def test_a_stable_id_and_states(make_pipeline: Any, tmp_path: Path) -> None:
    async with make_pipeline() as p:
        job_id = await p.submit()
        assert await p.submit() == job_id  # same request, same job
        queued = await p.store.get_job(job_id)
        assert queued.state is JobState.QUEUED and not queued.published
        p.start_relay()
        await p.start_worker()
        # The relay marks the row after its confirm, possibly after the worker finished.
        job = await p.wait_for(job_id, lambda j: done(j) and j.published)
        assert job.state is JobState.SUCCEEDED and job.attempt == 1
        assert job.result_key == f"exports/acme/{job_id}.csv"
        await _wait_kind(p, job_id, "ack_sent")  # written just after the ack
        kinds = await p.kinds(job_id)
        # "published" is recorded after the confirm, so it may land after a fast claim.
        assert kinds[0] == "accepted" and "published" in kinds
        assert [k for k in kinds if k != "published"] == [
            "accepted",
            "claimed",
            "result_saved",
            "ack_sent",
        ]
        path = tmp_path / "exports" / job.result_key
        rows = list(csv.reader(io.StringIO(path.read_text())))
        async with p.rt.engine.connect() as conn:
            expected = await ledger.count(conn, "acme", "2020-05")
        assert len(rows) == expected + 1 and rows[0][0] == "entry_id"
        assert job.result_meta["rows"] == expected
        assert result_files(tmp_path / "exports") == [path]


async def test_b_outbox_row_survives_restart_and_is_published_later(
    make_pipeline: Any,
) -> None:
    async with make_pipeline() as p:
        job_id = await p.submit()
        job = await p.store.get_job(job_id)
        assert job.state is JobState.QUEUED and not job.published
        assert await p.store.outbox_backlog() == 1
    # "Restart": a new runtime on the same database; the row is still there, unpublished.
    async with make_pipeline() as p:
        assert await p.store.outbox_backlog() == 1
        p.start_relay()
        job = await p.wait_for(job_id, lambda j: j.published)
        assert (await p.kinds(job_id))[:2] == ["accepted", "published"]
        assert await p.store.outbox_backlog() == 0


async def test_c_transient_error_then_success_and_ack_after_result(make_pipeline: Any) -> None:
    async with make_pipeline(faults="export.run:transient:1") as p:
        job_id = await p.submit()
        p.start_relay()
        await p.start_worker()
        job = await p.wait_for(job_id, done)
        assert job.state is JobState.SUCCEEDED and job.attempt == 2
        await _wait_kind(p, job_id, "ack_sent", count=2)
        kinds = await p.kinds(job_id)
        assert "retry_scheduled" in kinds
        assert kinds.index("retry_scheduled") < kinds.index("result_saved")
        assert kinds.index("result_saved") < len(kinds) - 1 - kinds[::-1].index("ack_sent")
        assert kinds.count("result_saved") == 1
        events = await p.store.events(job_id)
        retry = next(e for e in events if e.kind == "retry_scheduled")
        assert "injected transient" in retry.detail["error"] and retry.detail["delaySeconds"] == 1


async def test_d_invalid_payload_is_quarantined_not_requeued(make_pipeline: Any) -> None:
    async with make_pipeline(faults="export.run:invalid") as p:
        job_id = await p.submit()
        p.start_relay()
        await p.start_worker()
        job = await p.wait_for(job_id, done)
        assert job.state is JobState.QUARANTINED and job.attempt == 1
        assert "injected invalid" in (job.quarantine_reason or "")
        await _wait_quarantine_depth(p, 1)
        # The reject is recorded after the broker has it, so the queue can be ahead of the event.
        await _wait_kind(p, job_id, "rejected")
        kinds = await p.kinds(job_id)
        settled = [k for k in kinds if k != "published"]  # the mark may land after the reject
        assert kinds.count("claimed") == 1 and settled[-1] == "rejected"


async def test_d_malformed_message_is_quarantined(make_pipeline: Any) -> None:
    async with make_pipeline() as p:
        job_id = await p.submit()
        await p.rt.transport.publish(
            OutgoingMessage("work", b'{"jobId": "' + job_id.encode() + b'", "version": 9}')
        )
        await p.rt.transport.publish(OutgoingMessage("work", b"not json at all"))
        await p.start_worker()
        job = await p.wait_for(job_id, done)
        assert job.state is JobState.QUARANTINED and job.attempt == 0
        assert "invalid payload" in (job.quarantine_reason or "")
        await _wait_quarantine_depth(p, 2)


async def test_d_exhausted_attempts_are_quarantined(make_pipeline: Any) -> None:
    async with make_pipeline(faults="export.run:transient", max_attempts="2") as p:
        job_id = await p.submit()
        p.start_relay()
        await p.start_worker()
        job = await p.wait_for(job_id, done)
        assert job.state is JobState.QUARANTINED and job.attempt == 2
        assert "attempts exhausted (2/2)" in (job.quarantine_reason or "")
        await _wait_quarantine_depth(p, 1)
        assert (await p.kinds(job_id)).count("claimed") == 2


async def test_e_redelivery_of_succeeded_job_is_acked_without_new_result(
    make_pipeline: Any, tmp_path: Path
) -> None:
    async with make_pipeline() as p:
        job_id = await p.submit()
        p.start_relay()
        await p.start_worker()
        job = await p.wait_for(job_id, done)
        path = tmp_path / "exports" / job.result_key
        first = path.stat().st_mtime_ns
        await p.rt.transport.publish(
            OutgoingMessage("work", JobMessage(job_id, "report.export").encode())
        )
        await p.wait_for(job_id, lambda j: True)
        await _wait_kind(p, job_id, "duplicate_acked")
        kinds = await p.kinds(job_id)
        assert kinds.count("result_saved") == 1 and kinds.count("claimed") == 1
        assert path.stat().st_mtime_ns == first
        assert result_files(tmp_path / "exports") == [path]
        assert await p.rt.transport.quarantine_depth() == 0


async def test_f_worker_killed_mid_export_completes_once(
    make_pipeline: Any, tmp_path: Path
) -> None:
    async with make_pipeline(faults="export.run:crash:1") as p:
        job_id = await p.submit()
        p.start_relay()
        await p.start_worker()
        await p.kill_crashed_worker()
        crashed = await p.store.get_job(job_id)
        assert crashed.state is JobState.RUNNING and crashed.attempt == 1
        await p.start_worker()  # the replacement process
        job = await p.wait_for(job_id, done, timeout=40)
        assert job.state is JobState.SUCCEEDED and job.attempt == 2
        kinds = await p.kinds(job_id)
        assert kinds.count("result_saved") == 1
        assert result_files(tmp_path / "exports") == [tmp_path / "exports" / job.result_key]


async def test_g_unroutable_publish_is_not_marked_published(make_pipeline: Any) -> None:
    async with make_pipeline() as p:
        job_id = await p.submit()
        async with p.rt.engine.begin() as conn:  # a destination with no queue behind it
            # A queue nobody declared: unroutable on every transport (the local one routes any
            # delay of a known queue since Retry(delay=), so a delay alone no longer is).
            await conn.execute(outbox.update().values(destination="retry.nosuchqueue.5s"))
        relay = Relay(p.rt)
        assert await relay.relay_once() == 1
        job = await p.store.get_job(job_id)
        assert not job.published and "unroutable" in (job.last_publish_error or "")
        assert await p.store.outbox_backlog() == 1
        assert relay.published == 0 and relay.failed == 1


async def _wait_quarantine_depth(p: Pipeline, expected: int) -> None:
    deadline = time.monotonic() + 10
    depth = -1
    while time.monotonic() < deadline:
        depth = await p.rt.transport.quarantine_depth()
        if depth == expected:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"quarantine depth {depth}, expected {expected}")


async def _wait_kind(p: Pipeline, job_id: str, kind: str, count: int = 1) -> None:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if (await p.kinds(job_id)).count(kind) >= count:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"no {kind} event for {job_id}: {await p.kinds(job_id)}")
