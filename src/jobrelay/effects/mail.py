"""Outgoing mail over SMTP (aiosmtplib): deliver one composed message and say what happened.

What matters to the caller is not only "did it work" but "could it have worked": the effects
ledger records a refusal differently from an unknown outcome. So every failure leaves this
module as one of three errors from our tree:

- ``TransientError``: the server certainly did not take the message and may later (it could
  not be reached, or it answered 4xx). Retried.
- ``PermanentError``: the server certainly did not take it and never will (5xx: no such
  mailbox, sender refused, authentication failed). The job is quarantined with the reply.
- ``EffectOutcomeUnknown``: the conversation broke before the server's final answer (a
  disconnect, a read timeout). It may have accepted the message. Retried, and the ledger
  keeps the doubt, so the resend is recorded as a possible duplicate.

``smtp://`` upgrades with STARTTLS when the server offers it; ``smtps://`` is TLS from the
first byte. ``user:password@`` in the URL logs in.
"""

from __future__ import annotations

from dataclasses import dataclass
from email.message import EmailMessage
from urllib.parse import unquote, urlsplit

from jobrelay.errors import ConfigError, EffectOutcomeUnknown, PermanentError, TransientError

DEFAULT_TIMEOUT_SECONDS = 30.0


@dataclass(frozen=True)
class SmtpTarget:
    hostname: str
    port: int
    use_tls: bool
    username: str | None = None
    password: str | None = None


def parse_smtp_url(url: str) -> SmtpTarget:
    parts = urlsplit(url)
    if parts.scheme not in {"smtp", "smtps"} or not parts.hostname:
        raise ConfigError("JOBRELAY_SMTP_URL", "expected smtp://host:port or smtps://host:port")
    use_tls = parts.scheme == "smtps"
    return SmtpTarget(
        hostname=parts.hostname,
        port=parts.port or (465 if use_tls else 25),
        use_tls=use_tls,
        username=unquote(parts.username) if parts.username else None,
        password=unquote(parts.password) if parts.password else None,
    )


class Mailer:
    def __init__(self, url: str, *, timeout: float = DEFAULT_TIMEOUT_SECONDS) -> None:
        self.target = parse_smtp_url(url)
        self.timeout = timeout

    async def send(self, message: EmailMessage, *, sender: str, recipient: str) -> str:
        """Deliver ``message`` to exactly ``recipient``; returns the server's final reply."""
        import aiosmtplib  # here: a worker that never sends mail does not carry it (14 MiB)

        target = self.target
        try:
            _, reply = await aiosmtplib.send(
                message,
                sender=sender,
                recipients=[recipient],
                hostname=target.hostname,
                port=target.port,
                username=target.username,
                password=target.password,
                use_tls=target.use_tls,
                timeout=self.timeout,
            )
        except aiosmtplib.SMTPConnectError as exc:  # includes connect timeouts: nothing sent
            raise TransientError(f"SMTP server unreachable: {_describe(exc)}") from exc
        except aiosmtplib.SMTPRecipientsRefused as exc:
            codes = [r.code for r in exc.recipients]
            raise _refusal(min(codes, default=550), _describe(exc)) from exc
        except aiosmtplib.SMTPResponseException as exc:
            raise _refusal(exc.code, _describe(exc)) from exc
        except aiosmtplib.SMTPNotSupported as exc:
            raise PermanentError(f"SMTP server refused: {_describe(exc)}") from exc
        except (aiosmtplib.SMTPException, OSError) as exc:
            raise EffectOutcomeUnknown(
                f"SMTP conversation broke, the message may have been accepted: {_describe(exc)}"
            ) from exc
        return reply


def _refusal(code: int, reason: str) -> TransientError | PermanentError:
    text = f"SMTP server refused ({code}): {reason}"
    return PermanentError(text) if 500 <= code < 600 else TransientError(text)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".strip()[:500]
