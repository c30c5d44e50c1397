"""External effects: which addresses we may write to, and the effects ledger's states.

An e-mail cannot be taken back, and plain SMTP has no idempotency key the server honours.
What we can do is keep a ledger row per (job, kind) and move it through a small state
machine, so that every resend is a decision made from recorded facts:

    (none) | failed ──begin──▶ sending ──accepted──▶ sent
                                  │                        (server said no: ──▶ failed)
                      begin again │ (an attempt died after "sending": it may have sent)
                                  ▼
                          possible_duplicate ──accepted──▶ possible_duplicate (+ sent_at)

``sending`` left behind by a dead attempt is the one window SMTP cannot close: the server may
have accepted the message a moment before the process died. The next attempt resends with
the same Message-ID and records ``possible_duplicate`` instead of pretending to know.

Pure: the storage adapter reads the row, asks these functions, and writes the answer.
"""

from __future__ import annotations

import re
from enum import StrEnum

MAX_ADDRESS_LENGTH = 254  # RFC 5321 path limit minus the angle brackets
MAX_LOCAL_PART_LENGTH = 64
# dot-atom only (RFC 5322 3.2.3): no quoted local parts, comments or display names, so no
# spaces, commas, semicolons, angle brackets or line breaks can ever reach a header.
_ATEXT = r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+"
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_ADDRESS = re.compile(
    rf"(?P<local>{_ATEXT}(?:\.{_ATEXT})*)@(?P<domain>(?:{_LABEL}\.)+[A-Za-z]{{2,63}})"
)
_LIST_SEPARATORS = (",", ";")


def check_address(value: str) -> str:
    """Return ``value`` when it is ONE plain ``local@domain`` address, else raise ValueError.

    The message says what is wrong without echoing the value (it may be hostile).
    """
    if "\r" in value or "\n" in value:
        raise ValueError("must not contain line breaks")
    if len(value) > MAX_ADDRESS_LENGTH:
        raise ValueError(f"must be at most {MAX_ADDRESS_LENGTH} characters")
    if any(sep in value for sep in _LIST_SEPARATORS) or value.count("@") > 1:
        raise ValueError("must be a single address, not a list")
    match = _ADDRESS.fullmatch(value)
    if match is None:
        raise ValueError("must be a plain address such as name@example.com")
    if len(match["local"]) > MAX_LOCAL_PART_LENGTH:
        raise ValueError(f"the part before @ must be at most {MAX_LOCAL_PART_LENGTH} characters")
    return value


class EffectState(StrEnum):
    SENDING = "sending"  # about to hand the effect over; outcome not yet known
    SENT = "sent"  # the other side accepted it, once
    FAILED = "failed"  # the other side refused it: certainly not delivered
    POSSIBLE_DUPLICATE = "possible_duplicate"  # an earlier attempt may have delivered it too


def state_before_send(previous: EffectState | None, *, already_sent: bool) -> EffectState | None:
    """The state to record before handing the effect over; None: it was delivered, skip."""
    if already_sent:
        return None
    if previous is None or previous is EffectState.FAILED:
        return EffectState.SENDING
    # sending (an attempt died between "sending" and an outcome) or possible_duplicate.
    return EffectState.POSSIBLE_DUPLICATE


def state_after_send(current: EffectState) -> EffectState:
    """The other side accepted it: ``sent``, unless an earlier attempt may have, too."""
    return EffectState.SENT if current is EffectState.SENDING else EffectState.POSSIBLE_DUPLICATE


def state_after_refusal(current: EffectState) -> EffectState:
    """The other side refused THIS attempt; an earlier attempt's doubt is not cleared by it."""
    return EffectState.FAILED if current is EffectState.SENDING else EffectState.POSSIBLE_DUPLICATE
