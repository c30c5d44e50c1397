"""The effects ledger's ``begin`` is fenced on the caller's claim (issue 21, item 5).

Attempt 1 of a notification loses its lease (here: a lease of zero, so it has lapsed by the
store's clock the moment it is taken) and attempt 2 claims the job. Attempt 1, slow but
alive, then reaches ``begin``: it must be refused inside the ledger's transaction, before any
SMTP conversation, so the e-mail goes out exactly once, from the attempt that holds the job.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from jobrelay.domain.effects import EffectState
from jobrelay.domain.ids import follow_up_job_id, request_hash
from jobrelay.domain.states import JobState
from jobrelay.effects.notify_email import NotifyEmail
from jobrelay.errors import AttemptSuperseded
from jobrelay.library.operations import OperationContext
from jobrelay.storage.store import NewJob

from .effects_fixtures import (  # noqa: F401 (fixtures, registered by name)
    ADDRESS,
    MailServer,
    S3Server,
    aws_env_fixture,
    bucket_fixture,
    create_bucket,
    effect_settings,
    mail_server_fixture,
    s3_server_fixture,
    submit_export,
)
from .pipeline import Pipeline, pipeline, settings_for

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(params=["sqlite-local", "postgres-rabbitmq"])
def backend(request: pytest.FixtureRequest) -> tuple[str, str]:
    if request.param == "sqlite-local":
        return request.getfixturevalue("sqlite_url"), "local"
    return request.getfixturevalue("pg_app_url"), request.getfixturevalue("amqp_app_url")


async def _no_progress(done: int, total: int) -> None:
    return None


def _context(p: Pipeline, job: Any, attempt: int, worker: str | None) -> OperationContext:
    return OperationContext(
        job=job,
        attempt=attempt,
        store=p.store,
        results=p.rt.results,
        faults=p.rt.faults,
        report_progress=_no_progress,
        clock=p.rt.clock,
        worker=worker,
    )


async def _succeeded_export_and_its_notification(p: Pipeline) -> Any:
    """An export run to ``succeeded`` by the shipped worker, then (everything stopped) a
    notification job for it, queued: this test plays the workers of its attempts itself."""
    export_id = await submit_export(p, notify=None)
    p.start_relay()
    await p.start_worker()
    export = await p.wait_for(export_id, lambda j: j.state is JobState.SUCCEEDED)
    await p.stop_all()
    params = {"exportJobId": export.id, "to": ADDRESS}
    job = NewJob(
        job_id=follow_up_job_id(export.id, "notify.email"),
        type="notify.email",
        account_id=export.account_id,
        params=params,
        request_hash=request_hash(export.account_id, "notify.email", params),
        max_attempts=5,
    )
    job_id, _ = await p.store.submit(job, p.rt.clock())
    return job_id


async def test_a_superseded_attempt_is_refused_and_the_email_goes_once(
    backend: tuple[str, str], tmp_path: Path, s3_server: S3Server, mail_server: MailServer,
    bucket: str,
) -> None:  # fmt: skip
    await create_bucket(s3_server.endpoint, bucket)
    database_url, broker_url = backend
    extra = effect_settings(s3_server.endpoint, bucket, mail_server.url)
    async with pipeline(settings_for(database_url, broker_url, tmp_path / "x", **extra)) as p:
        notify_id = await _succeeded_export_and_its_notification(p)
        now = p.rt.clock()
        # Attempt 1 takes a lease that has lapsed at once; attempt 2 takes the job over.
        first = await p.store.claim_job(notify_id, "worker-1", now, timedelta(0))
        assert first is not None and first.attempt == 1
        second = await p.store.claim_job(notify_id, "worker-2", now, timedelta(minutes=5))
        assert second is not None and second.attempt == 2
        job = await p.store.get_job(notify_id)
        operation = NotifyEmail(p.rt.settings)

        # The superseded attempt reaches the ledger: refused, nothing sent, nothing written
        # to the ledger, and the refusal is in the timeline.
        with pytest.raises(AttemptSuperseded):
            await operation.run(_context(p, job, 1, "worker-1"))
        assert mail_server.messages == []
        assert await p.store.effects.get(notify_id, "email") is None
        fenced = [e for e in await p.store.events(notify_id) if e.kind == "effect_fenced"]
        assert len(fenced) == 1
        assert fenced[0].detail["attempt"] == 1 and fenced[0].detail["worker"] == "worker-1"
        assert fenced[0].detail["currentAttempt"] == 2

        # The same attempt number under another lease owner is refused too.
        with pytest.raises(AttemptSuperseded):
            await operation.run(_context(p, job, 2, "worker-1"))
        assert mail_server.messages == []

        # The live attempt sends, once.
        result = await operation.run(_context(p, job, 2, "worker-2"))
        assert result.meta["delivery"] == "sent"
        assert len(mail_server.messages) == 1

        # The superseded attempt coming back later finds it delivered: still nothing sent.
        again = await operation.run(_context(p, job, 1, "worker-1"))
        assert again.meta["delivery"] == "sent"
        assert len(mail_server.messages) == 1
        ledger = await p.store.effects.get(notify_id, "email")
        assert ledger is not None and ledger.state is EffectState.SENT and ledger.attempts == 1
        kinds = [e.kind for e in await p.store.events(notify_id)]
        assert kinds.count("effect_sending") == 1 and kinds.count("effect_fenced") == 2
