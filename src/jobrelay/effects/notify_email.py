"""``notify.email``: tell a person by e-mail that their export is ready, once, provably.

The notification is a job of its own, created by ``Store.complete`` in the transaction that
marks the export ``succeeded`` (see ``notification_for``). So it travels the same outbox,
relay, retries and quarantine as any job, and its id is derived from the export's id, so an
export can never have two.

Sending is keyed twice over:
- the message carries a stable ``Message-ID`` (``<export-<exportJobId>@<public host>>``), an
  ``Idempotency-Key`` header (the notify job's id) and a fixed ``Date`` (the export's finish
  time), so every resend is the same message, which mail systems can de-duplicate;
- the effects ledger row (job, ``email``) says ``sending`` before the SMTP conversation and
  ``sent`` after it, so a retry after a known send does not send again.

What SMTP cannot close: a process that dies after the server accepted the message and before
the ledger says ``sent`` (fault point ``notify.after_send``). The retry cannot know whether
the first copy went out, resends with the same Message-ID, and the ledger (and the job's
timeline) say ``possible_duplicate``. The link in the mail is the API's result URL, never a
presigned one: it must not expire in an inbox, and opening it needs the account's token.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping
from email.message import EmailMessage
from email.policy import SMTP
from email.utils import format_datetime
from typing import Any
from urllib.parse import urlsplit

from jobrelay.domain.effects import MAX_ADDRESS_LENGTH, check_address
from jobrelay.domain.ids import follow_up_job_id, request_hash
from jobrelay.domain.states import JobState
from jobrelay.effects.mail import Mailer
from jobrelay.errors import EffectOutcomeUnknown, OperationError, PermanentError
from jobrelay.library.operations import OperationContext, OperationResult
from jobrelay.settings import Settings
from jobrelay.storage.store import JobRecord, NewJob

__all__ = [
    "EFFECT_KIND",
    "MAX_ADDRESS_LENGTH",
    "NOTIFY_EMAIL",
    "NotifyEmail",
    "check_address",
    "message_id_for",
    "notification_for",
    "result_link",
]

TYPE = "notify.email"
NOTIFY_EMAIL = TYPE  # public: include with App.include(NotifyEmail, type=NOTIFY_EMAIL)
EFFECT_KIND = "email"
NOTIFY_PARAM = "notifyEmail"  # the export parameter that asks for a notification
_HOST = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9.-]{0,251}[A-Za-z0-9])?")


def notification_for(export: JobRecord) -> NewJob | None:
    """The notify job an export creates when it succeeds, or None when none was asked for."""
    to = export.params.get(NOTIFY_PARAM)
    if to is None:
        return None
    params = {"exportJobId": export.id, "to": to}
    return NewJob(
        job_id=follow_up_job_id(export.id, TYPE),
        type=TYPE,
        account_id=export.account_id,
        params=params,
        request_hash=request_hash(export.account_id, TYPE, params),
        max_attempts=export.max_attempts,
    )


def message_id_for(export_job_id: str, public_url: str) -> str:
    """Stable per export; the public host makes it differ between deployments (RFC 5322)."""
    host = urlsplit(public_url).hostname or ""
    return f"<export-{export_job_id}@{host if _HOST.fullmatch(host) else 'jobrelay'}>"


def result_link(export_job_id: str, public_url: str) -> str:
    return f"{public_url.rstrip('/')}/v1/jobs/{export_job_id}/result"


class NotifyEmail:
    type = TYPE

    def __init__(self, settings: Settings | None) -> None:
        self.settings = settings
        self.mailer = Mailer(settings.smtp_url) if settings and settings.smtp_url else None

    def validate(self, params: Mapping[str, Any]) -> None:
        if set(params) != {"exportJobId", "to"}:
            raise PermanentError(f"notify.email takes exportJobId and to, got {sorted(params)}")
        export_id, to = params["exportJobId"], params["to"]
        if not isinstance(export_id, str) or not _is_uuid(export_id):
            raise PermanentError("invalid exportJobId")
        if not isinstance(to, str):
            raise PermanentError("invalid address in to")
        try:
            check_address(to)
        except ValueError as exc:
            raise PermanentError(f"invalid address in to: {exc}") from None

    async def run(self, ctx: OperationContext) -> OperationResult:
        job = ctx.job
        self.validate(job.params)
        if self.mailer is None or self.settings is None or self.settings.mail_from is None:
            raise PermanentError("this worker has no JOBRELAY_SMTP_URL and JOBRELAY_MAIL_FROM")
        export = await ctx.store.get_job(job.params["exportJobId"])
        if export is None or export.account_id != job.account_id:
            raise PermanentError("the export this notification is about does not exist")
        if export.state is not JobState.SUCCEEDED:
            raise PermanentError(f"the export is {export.state.value}, not succeeded")
        message = self.compose(job, export)
        message_id = str(message["Message-ID"])
        ledger = ctx.store.effects
        permit = await ledger.begin(
            job.id, EFFECT_KIND, message_id, ctx.clock(), attempt=ctx.attempt, worker=ctx.worker
        )
        if not permit.send:  # an earlier attempt delivered it and recorded that
            return OperationResult(
                result_key=message_id,
                meta={"messageId": message_id, "delivery": permit.record.state.value},
            )
        try:
            await self.mailer.send(
                message, sender=self.settings.mail_from, recipient=job.params["to"]
            )
        except EffectOutcomeUnknown:
            raise  # the ledger keeps "sending": the next attempt knows it may be a duplicate
        except OperationError as exc:
            await ledger.mark_refused(job.id, EFFECT_KIND, str(exc), ctx.clock())
            raise
        # The window SMTP cannot close: accepted by the server, not yet recorded as sent.
        ctx.faults.hit("notify.after_send", attempt=ctx.attempt, params=job.params)
        record = await ledger.mark_sent(job.id, EFFECT_KIND, ctx.clock())
        return OperationResult(
            result_key=message_id,
            meta={"messageId": message_id, "delivery": record.state.value},
        )

    def compose(self, job: JobRecord, export: JobRecord) -> EmailMessage:
        """The same message on every attempt: only its envelope's timing differs."""
        assert self.settings is not None and self.settings.mail_from is not None
        public_url = self.settings.public_url
        account, period = export.params.get("accountId"), export.params.get("period")
        link = result_link(export.id, public_url)
        message = EmailMessage(policy=SMTP)
        message["From"] = self.settings.mail_from
        message["To"] = job.params["to"]
        message["Subject"] = f"Your export for {account}, {period} is ready"
        message["Date"] = format_datetime(export.updated_at)
        message["Message-ID"] = message_id_for(export.id, public_url)
        message["Idempotency-Key"] = job.id
        message["Auto-Submitted"] = "auto-generated"  # RFC 3834: no auto-replies, please
        message["X-Jobrelay-Job-Id"] = export.id
        message.set_content(
            f"Your export of account {account} for {period} is ready.\n\n"
            f"Download it with your API token (Authorization: Bearer …):\n{link}\n\n"
            f"Export job: {export.id}\n"
        )
        return message


def _is_uuid(value: str) -> bool:
    try:
        return str(uuid.UUID(value)) == value
    except ValueError:
        return False
