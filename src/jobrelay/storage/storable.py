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


def value_json(value: Any, max_bytes: int) -> str | None:
    """The value a job returned as the JSON text its completion stores (None for None), or
    ``ValueError`` saying why it cannot be stored: not JSON (a set, a ``Decimal``, NaN, an
    object), or over ``max_bytes`` (``JOBRELAY_RESULT_MAX_BYTES``). Either is the same on
    every attempt, so the job fails at once, never retried into repeating its effects.
    ASCII-escaped: no text a database refuses (a NUL byte, a lone surrogate) reaches it."""
    if value is None:
        return None
    try:
        text = json.dumps(value, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError, RecursionError) as exc:
        raise ValueError(
            f"the job returned a value that is not JSON ({type(value).__name__}):"
            f" {safe_text(str(exc))}; return a dict, list, str, number, bool or None"
        ) from None
    if len(text) > max_bytes:
        raise ValueError(
            f"the job returned a value of {len(text):,} bytes as JSON, over"
            f" JOBRELAY_RESULT_MAX_BYTES ({max_bytes:,}); store it as an object and return"
            " its key (jobrelay.Result(key=...))"
        )
    return text
