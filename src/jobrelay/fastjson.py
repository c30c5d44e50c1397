"""JSON for the hot path and the log lines: orjson where it gives what ``json`` gives.

The worker encodes a few JSON texts per job (event details, log lines) and decodes every
``json`` column of the rows its hot statements return; the stdlib spends most of that time.
orjson is several times faster but does not agree with ``json`` on everything, so each
function here hands the cases where they differ to the stdlib, and the value written or
read is the one ``json`` would give:

- an integer of 19 digits or more: orjson reads one past 64 bits as a float (silently: a
  payload's account number would change), and refuses to write one;
- a lone surrogate (``"\\ud800"``): orjson refuses it both ways;
- a ``datetime`` or a dataclass goes through ``default``, as with ``json``, not orjson's own
  encoding; keys that are not strings are written as ``json`` writes them.

One difference is kept on purpose: NaN and the infinities are written ``null``, valid JSON,
where ``json`` writes ``NaN`` (not JSON: PostgreSQL refuses it). What must refuse them (a
result's meta, ``storable.outcome_json``) uses ``json`` with ``allow_nan=False``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import orjson

_OPTIONS = orjson.OPT_NON_STR_KEYS | orjson.OPT_PASSTHROUGH_DATETIME
_OPTIONS |= orjson.OPT_PASSTHROUGH_DATACLASS
# Past what orjson reads as an integer (it reads the digits as a float instead).
_LONG_DIGITS = re.compile(r"\d{19}")


def dumps(value: Any, default: Callable[[Any], Any] | None = None) -> str:
    """``json.dumps(value, default=default)`` as a value: compact, non-ASCII kept as is
    (what orjson cannot write comes from ``json``, escaped to ASCII)."""
    try:
        return orjson.dumps(value, default=default, option=_OPTIONS).decode()
    except orjson.JSONEncodeError:
        # A 65-bit integer, a lone surrogate, a key orjson cannot write: as json does
        # (which raises the same TypeError/ValueError for what it cannot write either).
        return json.dumps(value, default=default, separators=(",", ":"))


def loads(text: str | bytes) -> Any:
    """``json.loads(text)``; orjson unless it would read a long integer as a float."""
    if _LONG_DIGITS.search(text if isinstance(text, str) else text.decode()) is None:
        try:
            return orjson.loads(text)
        except orjson.JSONDecodeError:
            pass  # a lone surrogate, NaN: json reads them
    return json.loads(text)
