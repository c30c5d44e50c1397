"""The pure rules behind external effects: addresses, the ledger's states, the new settings,
the ``notify.after_send`` fault point, and the message a notification sends."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from jobrelay.domain.effects import (
    EffectState,
    check_address,
    state_after_refusal,
    state_after_send,
    state_before_send,
)
from jobrelay.domain.ids import follow_up_job_id, job_id_for
from jobrelay.domain.states import JobState
from jobrelay.effects.mail import parse_smtp_url
from jobrelay.effects.notify_email import NotifyEmail, message_id_for, notification_for
from jobrelay.errors import ConfigError, InvalidParams, PermanentError
from jobrelay.exports.shipped import report_export
from jobrelay.observe.faults import Faults, parse
from jobrelay.results.s3 import parse_s3_url
from jobrelay.settings import load_settings
from jobrelay.storage.store import JobRecord

S, SENT, F, PD = (
    EffectState.SENDING,
    EffectState.SENT,
    EffectState.FAILED,
    EffectState.POSSIBLE_DUPLICATE,
)


@pytest.mark.parametrize("good", ["a@b.co", "first.last+tag@mail.example.com", "x_y-z@d-1.io"])
def test_plain_addresses_pass(good: str) -> None:
    assert check_address(good) == good


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        ("a@b.co\r\nBcc: c@d.co", "line breaks"),
        ("a@b.co\n", "line breaks"),  # a regex `$` would have let this through
        ("a@b.co,c@d.co", "not a list"),
        ("a@b.co; c@d.co", "not a list"),
        ("a@b@c.co", "not a list"),
        ("Name <a@b.co>", "plain address"),
        ('"a b"@c.co', "plain address"),
        ("a@localhost", "plain address"),
        (".a@b.co", "plain address"),
        ("a..b@c.co", "plain address"),
        ("a@-b.co", "plain address"),
        ("ä@b.co", "plain address"),
        ("x" * 65 + "@b.co", "before @"),
        ("a@" + "b" * 250 + ".co", "254"),
    ],
)
def test_anything_but_one_plain_address_is_refused(bad: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        check_address(bad)


def test_ledger_states() -> None:
    # First attempt, and an attempt after a definite refusal: plain "sending".
    assert state_before_send(None, already_sent=False) is S
    assert state_before_send(F, already_sent=False) is S
    # A row left in "sending" means an attempt died with the outcome unknown.
    assert state_before_send(S, already_sent=False) is PD
    assert state_before_send(PD, already_sent=False) is PD
    # Recorded as delivered: never send again.
    for previous in (SENT, PD):
        assert state_before_send(previous, already_sent=True) is None
    assert state_after_send(S) is SENT and state_after_send(PD) is PD
    assert state_after_refusal(S) is F and state_after_refusal(PD) is PD  # doubt is kept


def test_follow_up_id_depends_on_the_parent_only() -> None:
    secret = bytes(range(32))
    parent = job_id_for(secret, "acme", "report.export", {"accountId": "acme", "period": "2020-05"})
    assert follow_up_job_id(parent, "notify.email") == follow_up_job_id(parent, "notify.email")
    assert follow_up_job_id(parent, "notify.email") != parent
    assert follow_up_job_id(parent, "notify.email") != follow_up_job_id(parent, "other")


def test_effect_settings_validate_and_name_the_variable() -> None:
    s = load_settings(
        results_url="s3://my-bucket/some/prefix",
        s3_endpoint_url="http://127.0.0.1:9000",
        smtp_url="smtp://mailer:pw@mail.example.com:2525",
        mail_from="jobrelay@example.com",
        public_url="https://exports.example.com/",
    )
    assert s.public_url == "https://exports.example.com"
    assert s.redacted()["smtp_url"] == "smtp://mailer:***@mail.example.com:2525"
    assert parse_s3_url(s.results_url) == ("my-bucket", "some/prefix")
    assert parse_s3_url("s3://my-bucket") == ("my-bucket", "")
    target = parse_smtp_url(s.smtp_url or "")
    assert (target.hostname, target.port, target.username) == ("mail.example.com", 2525, "mailer")
    assert parse_smtp_url("smtps://mail.example.com").port == 465
    assert load_settings().smtp_url is None and load_settings().mail_from is None
    for field, value, variable in [
        ("results_url", "s3://Bad_Bucket/x", "JOBRELAY_RESULTS_URL"),
        ("results_url", "s3://", "JOBRELAY_RESULTS_URL"),
        ("s3_endpoint_url", "ftp://x", "JOBRELAY_S3_ENDPOINT_URL"),
        ("smtp_url", "http://mail", "JOBRELAY_SMTP_URL"),
        ("smtp_url", "smtp://mail:notaport", "JOBRELAY_SMTP_URL"),
        ("mail_from", "not-an-address", "JOBRELAY_MAIL_FROM"),
        ("public_url", "exports.example.com", "JOBRELAY_PUBLIC_URL"),
    ]:
        with pytest.raises(ConfigError) as caught:
            load_settings(**{field: value})
        assert caught.value.variable == variable, (field, value)
    with pytest.raises(ConfigError) as caught:
        load_settings(smtp_url="smtp://mail.example.com")  # without JOBRELAY_MAIL_FROM
    assert caught.value.variable == "JOBRELAY_MAIL_FROM"


class Crashed(BaseException):
    pass


def _raise(point: str) -> None:
    raise Crashed(point)


def test_notify_after_send_fault_counts_attempts_and_takes_selectors() -> None:
    assert [(f.point, f.n) for f in parse("notify.after_send:crash:1")] == [
        ("notify.after_send", 1)
    ]
    faults = Faults("notify.after_send:crash:1@to=a@b.co", crash_handler=_raise)  # type: ignore[arg-type]
    faults.hit("notify.after_send", attempt=1, params={"to": "c@d.co"})
    faults.hit("notify.after_send", attempt=2, params={"to": "a@b.co"})
    with pytest.raises(Crashed):
        faults.hit("notify.after_send", attempt=1, params={"to": "a@b.co"})
    with pytest.raises(ConfigError):
        parse("notify.after_send:transient")


def _export(params: dict[str, str]) -> JobRecord:
    t = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    return JobRecord(
        id="355781a6-5d2a-57ff-a430-b2902eefab0f", type="report.export", account_id="acme",
        params=params, idempotency_key=None, state=JobState.SUCCEEDED, attempt=1,
        max_attempts=4, result_key="k", result_meta={}, last_error=None,
        quarantine_reason=None, next_attempt_at=None, lease_owner=None, lease_expires_at=None,
        progress_done=None, progress_total=None, created_at=t, updated_at=t, published=True,
        unpublished_since=None, last_publish_error=None,
    )  # fmt: skip


def test_notification_job_and_its_message_are_stable() -> None:
    export = _export({"accountId": "acme", "period": "2020-05", "notifyEmail": "ops@example.com"})
    report_export.validate(export.params)
    assert notification_for(_export({"accountId": "acme", "period": "2020-05"})) is None
    job = notification_for(export)
    assert job is not None and job == notification_for(export)
    assert job.job_id == follow_up_job_id(export.id, "notify.email")
    assert job.params == {"exportJobId": export.id, "to": "ops@example.com"}
    assert job.account_id == "acme" and job.max_attempts == 4
    settings = load_settings(
        smtp_url="smtp://127.0.0.1:1",
        mail_from="jobrelay@example.com",
        public_url="https://exports.example.com",
    )
    notify = NotifyEmail(settings)
    notify.validate(job.params)
    record = _export(job.params)
    first, again = notify.compose(record, export), notify.compose(record, export)
    assert first.as_bytes() == again.as_bytes()  # a resend is the same message
    assert first["Message-ID"] == f"<export-{export.id}@exports.example.com>"
    assert first["Idempotency-Key"] == record.id
    assert f"https://exports.example.com/v1/jobs/{export.id}/result" in first.get_content()
    assert message_id_for(export.id, "http://[::1]:8000") == f"<export-{export.id}@jobrelay>"
    for bad in ({"exportJobId": export.id}, {**job.params, "to": "a@b.co\nBcc: x@y.co"}):
        with pytest.raises(PermanentError):
            notify.validate(bad)
    with pytest.raises(InvalidParams, match="notifyEmail"):  # a job definition's, as enqueue's
        report_export.validate({**export.params, "notifyEmail": "a@b.co, c@d.co"})
