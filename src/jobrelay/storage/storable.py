"""What the store can keep, checked before a statement is sent.

PostgreSQL's ``text`` refuses a NUL byte (SQLSTATE 22021), and a value the JSON encoder
refuses (a ``Decimal``, a set, NaN) fails while the statement is bound. Either fails the
same way every time, so it must never be retried as an outage, and in a batched statement it
must not fail the neighbours that share it. So: free text meant for people (an error
message, a quarantine reason) is stored with its NUL bytes escaped as the four characters
``\\x00``, which keeps what was there readable; a result key names an object, and a key
changed here would name another one, so an outcome whose key or meta cannot be stored is
refused (``StoreDataError``) and the worker quarantines the job saying why.
"""

from __future__ import annotations

import json
from typing import Any

from jobrelay.errors import StoreDataError
from jobrelay.storage.records import jsonable

NUL = "\x00"
NUL_ESCAPED = "\\x00"


def safe_text(text: str) -> str:
    """``text`` as the store can keep it: each NUL byte written out as ``\\x00`` and each
    lone surrogate (a str no UTF-8 database holds) as ``\\udXXX``."""
    text = text.replace(NUL, NUL_ESCAPED) if NUL in text else text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def outcome_json(result_key: str | None, meta: dict[str, Any]) -> str:
    """The result meta as the JSON text a completion stores, or StoreDataError saying why
    this outcome cannot be stored (checked per job, so only that job fails)."""
    if result_key is not None and NUL in result_key:
        raise StoreDataError(f"the result key {safe_text(result_key)!r} holds a NUL byte")
    try:
        return json.dumps(jsonable(meta), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise StoreDataError(f"the result meta is not JSON: {safe_text(str(exc))}") from None
