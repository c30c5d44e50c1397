"""Hooks (issue 40, item 4), on both backends through the relay, the broker and a real worker:
``on_success``, ``on_retry`` and ``on_failure`` are called once each outcome has committed
(the hook reads it), never for another type when ``type=`` names one; a hook that raises is
logged and changes nothing; a worker killed between the commit and the ack calls
``on_success`` again on the redelivery (at least once)."""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

import pytest
from pydantic import BaseModel
from sqlalchemy import update

import jobrelay
from jobrelay.domain.states import JobState
from jobrelay.library.hooks import JobOutcome
from jobrelay.storage.tables import outbox

from .ops_fixtures import eventually

pytestmark = pytest.mark.timeout(120)


class Ask(BaseModel):
    fail: str = "never"  # "once", "always"


app = jobrelay.App()
seen: list[tuple[str, str, int, str | None, str | None]] = []
states: list[str | None] = []


@app.job("lab.hooked", params=Ask, max_attempts=2, retry_delays=(1,))
async def hooked(ctx: jobrelay.JobContext[Ask], p: Ask) -> dict[str, int]:
    if p.fail == "always" or (p.fail == "once" and ctx.attempt == 1):
        raise jobrelay.Retry("the ledger is busy")
    return {"attempt": ctx.attempt}


@app.job("lab.other", params=Ask)
async def other(ctx: jobrelay.JobContext[Ask], p: Ask) -> None:
    return None


def _record(outcome: JobOutcome) -> None:
    seen.append(
        (outcome.outcome, outcome.job.type, outcome.attempt, outcome.reason, outcome.job.id)
    )


@app.on_success
async def on_success(outcome: JobOutcome) -> None:
    _record(outcome)
    # Called after the commit: the outcome is the database's already.
    job = await hooks_store[0].get_job(outcome.job.id)
    states.append(job.state.value if job is not None else None)


@app.on_retry(type=hooked)
def on_retry(outcome: JobOutcome) -> None:  # a plain def hook: run on a thread
    _record(outcome)


@app.on_failure(type="lab.hooked")
async def on_failure(outcome: JobOutcome) -> None:
    _record(outcome)


@app.on_success(type="lab.other")
async def raises(outcome: JobOutcome) -> None:
    raise RuntimeError("the hook's own bug")


hooks_store: list[Any] = []


@pytest.fixture(autouse=True)
def fresh() -> None:
    seen.clear()
    states.clear()
    hooks_store.clear()


async def test_each_outcome_calls_its_hooks_once_after_it_committed(make_pipeline: Any) -> None:
    async with make_pipeline() as p:
        p.rt = dataclasses.replace(p.rt, app=app)
        hooks_store.append(p.store)
        ok, _ = await p.store.submit(hooked.new_job(Ask()), p.rt.clock())
        retried, _ = await p.store.submit(hooked.new_job(Ask(fail="once")), p.rt.clock())
        failed, _ = await p.store.submit(hooked.new_job(Ask(fail="always")), p.rt.clock())
        p.start_relay()
        await p.start_worker()
        for job_id in (ok, retried, failed):
            await p.wait_for(job_id, lambda j: j.state.is_terminal)
        await p.stop_all()
    by_job = {job_id: [s[:4] for s in seen if s[4] == job_id] for job_id in (ok, retried, failed)}
    assert by_job[ok] == [("succeeded", "lab.hooked", 1, None)]
    reason = "the ledger is busy"
    assert [s[:3] for s in by_job[retried]] == [
        ("retried", "lab.hooked", 1),
        ("succeeded", "lab.hooked", 2),
    ]
    assert by_job[retried][0][3] is not None and reason in by_job[retried][0][3]
    assert [s[:3] for s in by_job[failed]] == [
        ("retried", "lab.hooked", 1),
        ("quarantined", "lab.hooked", 2),
    ]
    assert states == ["succeeded", "succeeded"]


async def test_a_hook_that_raises_changes_nothing(
    make_pipeline: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="jobrelay.worker")
    async with make_pipeline() as p:
        p.rt = dataclasses.replace(p.rt, app=app)
        hooks_store.append(p.store)
        job_id, _ = await p.store.submit(other.new_job(Ask()), p.rt.clock())
        p.start_relay()
        await p.start_worker()
        job = await p.wait_for(job_id, lambda j: j.state is JobState.SUCCEEDED)
        await p.stop_all()
        kinds = await p.kinds(job_id)
    failures = [r for r in caplog.records if getattr(r, "event", None) == "hook_failed"]
    assert [getattr(r, "jobId", None) for r in failures] == [job_id]
    assert "the hook's own bug" in failures[0].getMessage()
    assert job.attempt == 1 and kinds.count("result_saved") == 1 and "ack_sent" in kinds
    # on_success (every type) still ran, before the raising one for this type.
    assert [s[:2] for s in seen] == [("succeeded", "lab.other")]


async def test_a_worker_killed_before_the_ack_calls_on_success_again(make_pipeline: Any) -> None:
    async with make_pipeline(faults="worker.before_ack:crash:1", lease_seconds="5") as p:
        p.rt = dataclasses.replace(p.rt, app=app)
        hooks_store.append(p.store)
        job_id, _ = await p.store.submit(hooked.new_job(Ask()), p.rt.clock())
        p.start_relay()
        await p.start_worker()
        await p.kill_crashed_worker(timeout=60)
        assert [s[0] for s in seen] == ["succeeded"]  # committed, hooked, then killed
        await p.start_worker()  # the redelivery: a duplicate of the finished job
        await p.wait_for(job_id, lambda j: j.state is JobState.SUCCEEDED)

        async def acked() -> bool:
            return "ack_sent" in await p.kinds(job_id)

        await eventually(acked, what="the redelivery acked")
        await p.stop_all()
        kinds = await p.kinds(job_id)
    assert kinds.count("result_saved") == 1
    assert [s[0] for s in seen] == ["succeeded", "succeeded"]


@app.job("lab.filed", params=Ask)
async def filed(ctx: jobrelay.JobContext[Ask], p: Ask) -> jobrelay.Result:
    key = ctx.result_key("out.txt")
    async with ctx.writer(key) as out:
        await out.write(b"done\n")
    return jobrelay.Result(key=key)


async def test_a_file_result_is_no_reason_and_a_bad_copy_calls_on_failure(
    make_pipeline: Any,
) -> None:
    async with make_pipeline() as p:
        p.rt = dataclasses.replace(p.rt, app=app)
        hooks_store.append(p.store)
        with_file, _ = await p.store.submit(filed.new_job(Ask()), p.rt.clock())
        # A job whose only message is one no worker can read: an unexpected field.
        bad, _ = await p.store.submit(hooked.new_job(Ask()), p.rt.clock())
        body = json.dumps({"jobId": bad, "type": "lab.hooked", "version": 1, "evil": 1})
        async with p.rt.engine.begin() as conn:
            await conn.execute(
                update(outbox).where(outbox.c.job_id == bad).values(published_at=p.rt.clock())
            )
            await p.store.next_message(conn, bad, body.encode(), "default", p.rt.clock())
        p.start_relay()
        await p.start_worker()
        await p.wait_for(with_file, lambda j: j.state is JobState.SUCCEEDED)
        job = await p.wait_for(bad, lambda j: j.state is JobState.QUARANTINED)

        async def hooked_both() -> bool:
            return {s[4] for s in seen} >= {with_file, bad}

        await eventually(hooked_both, what="both hooks")
        await p.stop_all()
    by_job = {job_id: [s[:4] for s in seen if s[4] == job_id] for job_id in (with_file, bad)}
    # A success names its result key in its decision, never as the hook's reason.
    assert by_job[with_file] == [("succeeded", "lab.filed", 1, None)]
    [(outcome, job_type, attempt, reason)] = by_job[bad]
    assert (outcome, job_type, attempt) == ("quarantined", "lab.hooked", 0)
    assert reason is not None and "unexpected fields" in reason
    assert job.quarantine_reason == reason
