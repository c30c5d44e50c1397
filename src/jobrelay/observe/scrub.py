"""The one scrubber: what no operator-facing text, log line or span attribute may show.

A job's failure text quotes its exception, and exceptions quote what they were given: a
driver's error names the DSN it could not reach (``postgresql://app:s3cret@db/...``), an
HTTP client's the URL with its token. Every text an operator or a tool reads passes through
``scrub`` before it is written (the last error, a quarantine reason, the attempts table, the
timeline's details, the stored traceback), when it is shown (rows written before this
scrubber existed), on every log line and on every span attribute and event.

Masked: a password in a URL (``scheme://user:***@host``), a libpq keyword password
(``password=***``), an API token (``jr_***``) and a bearer credential (``Bearer ***``). The
text around them is kept: it is what the reader needs.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

_SECRETS = (
    (re.compile(r"jr_[A-Za-z0-9_-]{16,}"), "jr_***"),
    (re.compile(r"(?i)(bearer\s+)[A-Za-z0-9._~+/=-]{8,}"), r"\1***"),
    # user:password@ after a scheme; the password may hold anything but whitespace, quotes
    # and a slash (the last @ before the first slash ends it: a password may hold an @ too).
    (re.compile(r"(://[^:/@\s\"']+:)[^\s\"'/]*@"), r"\1***@"),
    # A password given by name: libpq's keyword form (host=db password=s3cret), a query
    # parameter (?password=), an environment variable (PGPASSWORD=, DB_PASSWORD=), a
    # mapping ({'password': 's3cret'}); its value bare, or quoted either way.
    (
        re.compile(r"(?i)(password[\"']?\s*[=:]\s*)(?:'[^']*'|\"[^\"]*\"|[^\s&;\"',)}\\]+)"),
        r"\1***",
    ),
)


def scrub(text: str) -> str:
    """``text`` with every secret it holds masked."""
    # What each pattern needs before it can match: most texts hold none of it, and these
    # substring tests cost a fraction of one regular expression's search.
    lowered = text.lower()
    if not ("jr_" in text or "://" in text or "bearer" in lowered or "password" in lowered):
        return text
    for pattern, replacement in _SECRETS:
        text = pattern.sub(replacement, text)
    return text


def scrub_text(text: str | None) -> str | None:
    """``scrub`` of a text that may be absent (a job's last error)."""
    return None if text is None else scrub(text)


def scrubbed(value: Any) -> Any:
    """``value`` with ``scrub`` applied to every string in it (a timeline event's detail)."""
    if isinstance(value, str):
        return scrub(value)
    if isinstance(value, Mapping):
        return {k: scrubbed(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [scrubbed(v) for v in value]
    return value
