"""External effects exactly once, against real servers: S3 (moto) and SMTP (aiosmtpd).

The shipped relay and worker run in this process (pipeline.py). Every claim is checked on
the far side: objects listed in the bucket, messages the SMTP server recorded, rows in the
effects ledger. "Once" is shown by counting after a duplicate or a crash, not by hoping.
"""

from __future__ import annotations

import csv
import hashlib
import io
from pathlib import Path
from typing import Any

import pytest

from jobrelay.domain.effects import EffectState
from jobrelay.domain.ids import follow_up_job_id
from jobrelay.domain.messages import JobMessage
from jobrelay.domain.states import JobState
from jobrelay.effects.notify_email import NotifyEmail
from jobrelay.library.operations import OperationContext
from jobrelay.transport.base import OutgoingMessage

from .effects_fixtures import (  # noqa: F401 (fixtures, registered by name)
    ADDRESS,
    MAIL_FROM,
    PUBLIC_URL,
    MailServer,
    S3Server,
    aws_env_fixture,
    bucket_fixture,
    create_bucket,
    effect_settings,
    eventually,
    free_port,
    mail_server_fixture,
    object_bytes,
    object_keys,
    open_uploads,
    s3_server_fixture,
    submit_export,
)
from .pipeline import Pipeline, pipeline, settings_for

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(params=["sqlite-local", "postgres-rabbitmq"])
def backend(request: pytest.FixtureRequest) -> tuple[str, str]:
    if request.param == "sqlite-local":
        return request.getfixturevalue("sqlite_url"), "local"
    # The processes run least-privileged (see tests/conftest.py).
    return request.getfixturevalue("pg_app_url"), request.getfixturevalue("amqp_app_url")


@pytest.fixture
def sqlite_backend(sqlite_url: str) -> tuple[str, str]:
    return sqlite_url, "local"


def build(backend: tuple[str, str], tmp_path: Path, **extra: Any) -> Any:
    database_url, broker_url = backend
    return pipeline(settings_for(database_url, broker_url, tmp_path / "exports", **extra))


def finished(job: Any) -> bool:
    return bool(job.state in (JobState.SUCCEEDED, JobState.QUARANTINED))


def notify_id(export_id: str) -> str:
    return follow_up_job_id(export_id, "notify.email")


def object_key(export_id: str, attempt: int = 1, account: str = "acme") -> str:
    """Where the export's attempt ``attempt`` uploaded its result (its own key, recorded as
    the job's ``resultKey`` by its completion: issue 34, item 2)."""
    return f"jobrelay/exports/{account}/{export_id}.attempt-{attempt}.csv"


async def notify_jobs(p: Pipeline) -> list[Any]:
    return [j for j in await p.store.list_jobs(limit=1000) if j.type == "notify.email"]


async def run_to_the_end(p: Pipeline, export_id: str, timeout: float = 40) -> tuple[Any, Any]:
    export = await p.wait_for(export_id, finished, timeout=timeout)
    assert export.state is JobState.SUCCEEDED, export
    notify = await p.wait_for(notify_id(export_id), finished, timeout=timeout)
    assert notify.state is JobState.SUCCEEDED, notify
    return export, notify


async def test_one_object_and_one_email_per_job(
    backend: tuple[str, str], tmp_path: Path, s3_server: S3Server, mail_server: MailServer,
    bucket: str,
) -> None:  # fmt: skip
    await create_bucket(s3_server.endpoint, bucket)
    extra = effect_settings(s3_server.endpoint, bucket, mail_server.url)
    async with build(backend, tmp_path, **extra) as p:
        export_id = await submit_export(p)
        p.start_relay()
        await p.start_worker()
        export, notify = await run_to_the_end(p, export_id)

        # One object, at the winning attempt's key below the prefix, with its checksum.
        assert export.result_key == f"exports/acme/{export_id}.attempt-1.csv"
        assert await object_keys(s3_server.endpoint, bucket) == [object_key(export_id)]
        data = await object_bytes(s3_server.endpoint, bucket, object_key(export_id))
        assert hashlib.sha256(data).hexdigest() == export.result_meta["sha256"]
        assert export.result_meta["bytes"] == len(data)
        rows = list(csv.reader(io.StringIO(data.decode())))
        assert len(rows) == export.result_meta["rows"] + 1 and rows[0][0] == "entry_id"
        assert not (tmp_path / "exports").exists()  # nothing went to the file backend

        # One e-mail, keyed by the export's jobId, linking the API (not a presigned URL).
        await eventually(lambda: len(mail_server.messages) == 1, "the e-mail")
        received = mail_server.messages[0]
        assert received.mail_from == MAIL_FROM and received.rcpt_tos == [ADDRESS]
        message = received.message
        message_id = f"<export-{export_id}@exports.example.com>"
        assert message["Message-ID"] == message_id
        assert message["Idempotency-Key"] == notify.id
        assert message["To"] == ADDRESS
        body = message.get_payload(decode=True).decode()
        assert f"{PUBLIC_URL}/v1/jobs/{export_id}/result" in body
        assert "X-Amz" not in body and s3_server.endpoint not in body
        assert notify.result_key == message_id

        ledger = await p.store.effects.get(notify.id, "email")
        assert ledger.state is EffectState.SENT and ledger.attempts == 1
        assert ledger.message_id == message_id and ledger.sent_at is not None
        assert "follow_up_accepted" in await p.kinds(export_id)
        kinds = await p.kinds(notify.id)
        assert kinds[0] == "accepted" and "published" in kinds  # through the outbox
        assert kinds.count("effect_sending") == 1 and kinds.count("effect_sent") == 1

        # A duplicate delivery of the export is acked without a new object or e-mail.
        await p.rt.transport.publish(
            OutgoingMessage("work", JobMessage(export_id, "report.export").encode())
        )
        await eventually(lambda: _has(p, export_id, "duplicate_acked"), "the duplicate to be acked")
        assert (await p.kinds(export_id)).count("result_saved") == 1
        assert await object_keys(s3_server.endpoint, bucket) == [object_key(export_id)]
        assert len(await notify_jobs(p)) == 1 and len(mail_server.messages) == 1


async def _has(p: Pipeline, job_id: str, kind: str) -> bool:
    return kind in await p.kinds(job_id)


async def test_worker_killed_after_commit_before_ack_leaves_one_object_and_one_email(
    backend: tuple[str, str], tmp_path: Path, s3_server: S3Server, mail_server: MailServer,
    bucket: str,
) -> None:  # fmt: skip
    await create_bucket(s3_server.endpoint, bucket)
    extra = effect_settings(
        s3_server.endpoint, bucket, mail_server.url, faults="worker.before_ack:crash:1"
    )
    async with build(backend, tmp_path, **extra) as p:
        export_id = await submit_export(p)
        p.start_relay()
        await p.start_worker()
        await p.kill_crashed_worker()  # export committed succeeded (+ notify job), never acked
        crashed = await p.store.get_job(export_id)
        assert crashed.state is JobState.SUCCEEDED
        assert "ack_sent" not in await p.kinds(export_id)
        await p.start_worker()  # the replacement process
        _, notify = await run_to_the_end(p, export_id)
        await eventually(lambda: _has(p, export_id, "duplicate_acked"), "the redelivery")

        kinds = await p.kinds(export_id)
        assert kinds.count("result_saved") == 1 and kinds.count("follow_up_accepted") == 1
        assert await object_keys(s3_server.endpoint, bucket) == [object_key(export_id)]
        assert await open_uploads(s3_server.endpoint, bucket) == []
        assert [j.id for j in await notify_jobs(p)] == [notify.id]
        assert len(mail_server.messages) == 1
        ledger = await p.store.effects.get(notify.id, "email")
        assert ledger.state is EffectState.SENT and ledger.attempts == 1


async def test_crash_after_smtp_accepted_resends_same_message_as_possible_duplicate(
    backend: tuple[str, str], tmp_path: Path, s3_server: S3Server, mail_server: MailServer,
    bucket: str,
) -> None:  # fmt: skip
    """The one window plain SMTP cannot close, behaving exactly as documented."""
    await create_bucket(s3_server.endpoint, bucket)
    extra = effect_settings(
        s3_server.endpoint, bucket, mail_server.url, faults="notify.after_send:crash:1"
    )
    async with build(backend, tmp_path, **extra) as p:
        export_id = await submit_export(p)
        p.start_relay()
        await p.start_worker()
        await p.kill_crashed_worker()  # the server has the message; the ledger says "sending"
        assert len(mail_server.messages) == 1
        ledger = await p.store.effects.get(notify_id(export_id), "email")
        assert ledger.state is EffectState.SENDING and ledger.sent_at is None
        await p.start_worker()
        _, notify = await run_to_the_end(p, export_id)

        assert notify.attempt == 2
        messages = [m.message for m in mail_server.messages]
        assert len(messages) == 2  # resent: SMTP cannot tell us the first one arrived
        assert {m["Message-ID"] for m in messages} == {f"<export-{export_id}@exports.example.com>"}
        assert {m["Idempotency-Key"] for m in messages} == {notify.id}
        assert messages[0]["Date"] == messages[1]["Date"]  # the same message, byte for byte
        ledger = await p.store.effects.get(notify.id, "email")
        assert ledger.state is EffectState.POSSIBLE_DUPLICATE
        assert ledger.attempts == 2 and ledger.sent_at is not None
        assert notify.result_meta["delivery"] == "possible_duplicate"
        events = await p.store.events(notify.id)
        flagged = [e for e in events if e.kind == "possible_duplicate"]
        assert len(flagged) == 1 and flagged[0].detail["previous"] == "sending"
        assert await object_keys(s3_server.endpoint, bucket) == [object_key(export_id)]


async def test_transient_s3_failure_retries_then_succeeds_with_nothing_partial(
    sqlite_backend: tuple[str, str], tmp_path: Path, s3_server: S3Server,
    mail_server: MailServer, bucket: str,
) -> None:  # fmt: skip
    await create_bucket(s3_server.endpoint, bucket)
    s3_server.failing = True  # every PUT/POST answers 503 SlowDown
    extra = effect_settings(s3_server.endpoint, bucket, mail_server.url, retry_delays="2")
    async with build(sqlite_backend, tmp_path, **extra) as p:
        export_id = await submit_export(p)
        p.start_relay()
        await p.start_worker()
        waiting = await p.wait_for(export_id, lambda j: j.state is JobState.RETRY_WAIT)
        assert waiting.attempt == 1 and "SlowDown" in (waiting.last_error or "")
        assert s3_server.failed_writes >= 1
        assert await object_keys(s3_server.endpoint, bucket) == []  # nothing half-written
        s3_server.failing = False
        export, _ = await run_to_the_end(p, export_id)
        assert export.attempt == 2
        assert await object_keys(s3_server.endpoint, bucket) == [object_key(export_id, 2)]
        await eventually(lambda: len(mail_server.messages) == 1, "the e-mail")
        assert len(await notify_jobs(p)) == 1


async def test_unreachable_s3_endpoint_is_a_retry_not_a_lost_job(
    sqlite_backend: tuple[str, str], tmp_path: Path, aws_env: None, mail_server: MailServer,
    bucket: str,
) -> None:  # fmt: skip
    late = S3Server(port=free_port())  # its port has nothing behind it yet
    extra = effect_settings(late.endpoint, bucket, mail_server.url, max_attempts="5")
    # Stopped after the pipeline: a worker that stops may still clean up a staged object, and
    # a server gone before it leaves that call to botocore's connect timeouts (CI: a
    # teardown of 82 s that ran into the test's limit).
    try:
        async with build(sqlite_backend, tmp_path, **extra) as p:
            export_id = await submit_export(p)
            p.start_relay()
            await p.start_worker()
            waiting = await p.wait_for(export_id, lambda j: j.state is JobState.RETRY_WAIT)
            assert "Could not connect" in (waiting.last_error or ""), waiting.last_error
            late.start()
            await create_bucket(late.endpoint, bucket)
            export, _ = await run_to_the_end(p, export_id)
            assert export.attempt >= 2
            keys = [object_key(export_id, export.attempt)]
            assert await object_keys(late.endpoint, bucket) == keys
    finally:
        late.stop()


async def test_transient_smtp_refusal_retries_then_sends_once(
    sqlite_backend: tuple[str, str], tmp_path: Path, s3_server: S3Server,
    mail_server: MailServer, bucket: str,
) -> None:  # fmt: skip
    await create_bucket(s3_server.endpoint, bucket)
    mail_server.refuse("451 4.3.0 Try again later")
    extra = effect_settings(s3_server.endpoint, bucket, mail_server.url, retry_delays="2")
    async with build(sqlite_backend, tmp_path, **extra) as p:
        export_id = await submit_export(p)
        p.start_relay()
        await p.start_worker()
        waiting = await p.wait_for(notify_id(export_id), lambda j: j.state is JobState.RETRY_WAIT)
        assert "451" in (waiting.last_error or "")
        ledger = await p.store.effects.get(waiting.id, "email")
        assert ledger.state is EffectState.FAILED  # refused: certainly not delivered
        mail_server.refuse(None)
        _, notify = await run_to_the_end(p, export_id)
        assert notify.attempt == 2 and len(mail_server.messages) == 1
        ledger = await p.store.effects.get(notify.id, "email")
        assert ledger.state is EffectState.SENT and ledger.attempts == 2
        assert "possible_duplicate" not in await p.kinds(notify.id)


async def test_unreachable_smtp_server_is_a_retry_not_a_lost_job(
    sqlite_backend: tuple[str, str], tmp_path: Path, s3_server: S3Server, bucket: str,
) -> None:  # fmt: skip
    await create_bucket(s3_server.endpoint, bucket)
    late = MailServer(port=free_port())
    extra = effect_settings(s3_server.endpoint, bucket, late.url, max_attempts="5")
    async with build(sqlite_backend, tmp_path, **extra) as p:
        export_id = await submit_export(p)
        p.start_relay()
        await p.start_worker()
        waiting = await p.wait_for(notify_id(export_id), lambda j: j.state is JobState.RETRY_WAIT)
        assert "unreachable" in (waiting.last_error or ""), waiting.last_error
        late.start()
        try:
            _, notify = await run_to_the_end(p, export_id)
            assert notify.attempt >= 2 and len(late.messages) == 1
            ledger = await p.store.effects.get(notify.id, "email")
            assert ledger.state is EffectState.SENT
        finally:
            late.stop()


async def test_permanent_smtp_refusal_quarantines_the_notification_only(
    sqlite_backend: tuple[str, str], tmp_path: Path, s3_server: S3Server,
    mail_server: MailServer, bucket: str,
) -> None:  # fmt: skip
    await create_bucket(s3_server.endpoint, bucket)
    mail_server.refuse("550 5.1.1 No such mailbox")
    extra = effect_settings(s3_server.endpoint, bucket, mail_server.url)
    async with build(sqlite_backend, tmp_path, **extra) as p:
        export_id = await submit_export(p)
        p.start_relay()
        await p.start_worker()
        notify = await p.wait_for(notify_id(export_id), finished)
        assert notify.state is JobState.QUARANTINED and notify.attempt == 1
        assert "550" in (notify.quarantine_reason or "")
        assert (await p.store.get_job(export_id)).state is JobState.SUCCEEDED
        ledger = await p.store.effects.get(notify.id, "email")
        assert ledger.state is EffectState.FAILED and mail_server.messages == []


async def test_export_without_notify_email_sends_nothing(
    sqlite_backend: tuple[str, str], tmp_path: Path, s3_server: S3Server,
    mail_server: MailServer, bucket: str,
) -> None:  # fmt: skip
    await create_bucket(s3_server.endpoint, bucket)
    extra = effect_settings(s3_server.endpoint, bucket, mail_server.url)
    async with build(sqlite_backend, tmp_path, **extra) as p:
        export_id = await submit_export(p, notify=None)
        p.start_relay()
        await p.start_worker()
        export = await p.wait_for(export_id, finished)
        assert export.state is JobState.SUCCEEDED and "notifyEmail" not in export.params
        assert "follow_up_accepted" not in await p.kinds(export_id)
        assert await notify_jobs(p) == [] and mail_server.messages == []


async def test_a_rerun_after_the_ledger_says_sent_sends_nothing(
    sqlite_backend: tuple[str, str], tmp_path: Path, s3_server: S3Server,
    mail_server: MailServer, bucket: str,
) -> None:  # fmt: skip
    """Sent and recorded, but the job's own outcome was lost (a lease takeover, a failed
    commit): running the operation again consults the ledger and does not resend."""
    await create_bucket(s3_server.endpoint, bucket)
    extra = effect_settings(s3_server.endpoint, bucket, mail_server.url)
    async with build(sqlite_backend, tmp_path, **extra) as p:
        export_id = await submit_export(p)
        p.start_relay()
        await p.start_worker()
        _, notify = await run_to_the_end(p, export_id)
        assert len(mail_server.messages) == 1

        async def no_progress(done: int, total: int) -> None:
            return None

        operation = NotifyEmail(p.rt.settings)
        context = OperationContext(
            job=notify,
            attempt=notify.attempt + 1,
            store=p.store,
            results=p.rt.results,
            faults=p.rt.faults,
            report_progress=no_progress,
            clock=p.rt.clock,
        )
        result = await operation.run(context)
        assert result.meta["delivery"] == "sent" and result.result_key == notify.result_key
        assert len(mail_server.messages) == 1
        assert (await p.kinds(notify.id)).count("effect_skipped") == 1
        ledger = await p.store.effects.get(notify.id, "email")
        assert ledger.state is EffectState.SENT and ledger.attempts == 1
