"""The tutorial's own tests (docs/how-to/testing.md): the welcome job run for real in the
test's process on a database of its own, and what a signup enqueues."""

from __future__ import annotations

import jobrelay
from examples.first_job.app import Welcome, app, send_welcome
from examples.first_job.main import metadata, sign_up
from jobrelay.testing import Runner


async def test_a_signup_welcomes_its_user(jobrelay_runner: Runner) -> None:
    async with jobrelay_runner.engine.begin() as conn:
        await conn.run_sync(metadata.create_all)  # the application's own table
        signup_id, job_id = await sign_up(conn, "ada@example.com")

    await jobrelay_runner.drain()  # everything enqueued so far, run to its end

    job = await jobrelay_runner.job(job_id)
    assert job.state is jobrelay.JobState.SUCCEEDED
    assert await app.result(job_id) == {"signupId": signup_id, "welcomed": True}


async def test_a_bad_address_is_quarantined_without_a_retry(jobrelay_runner: Runner) -> None:
    await app.enqueue("welcome.send", Welcome(signup_id=7, email="nobody"))

    await jobrelay_runner.drain()

    [job] = await jobrelay_runner.jobs(type=send_welcome, state="quarantined")
    assert job.attempt == 1
    assert "not an email address" in (job.quarantine_reason or "")


async def test_a_signup_enqueues_one_welcome(jobrelay_enqueued: Runner) -> None:
    async with jobrelay_enqueued.engine.begin() as conn:
        await conn.run_sync(metadata.create_all)
        signup_id, _ = await sign_up(conn, "ada@example.com")

    [job] = await jobrelay_enqueued.jobs()  # recorded, never run
    assert (job.type, job.state) == ("welcome.send", jobrelay.JobState.QUEUED)
    assert job.params == {"signup_id": signup_id, "email": "ada@example.com"}
