"""The export's bytes: one CSV format, whichever path makes it.

The format is what Python's ``csv.writer`` writes with ``lineterminator="\\r\\n"`` and
minimal quoting: UTF-8, a header line, lines ending in CRLF, a cell quoted only when it
holds a comma, a quote, CR or LF (quotes doubled), an empty or NULL cell as nothing, dates
ISO, amounts with two decimals, text cells defanged (``defang``, also after a ``;``, a tab or
a line break inside a cell).

Two paths write it. On SQLite, ``python_lines`` defangs and formats raw rows and Python's
csv writer makes the lines (the reference). On PostgreSQL,
``COPY … TO STDOUT WITH CSV`` writes every cell itself, with the same quoting
rule, but it ends lines with a bare LF, and an LF may also sit inside a quoted cell, so the
line ends cannot simply be replaced. Instead every row gets one more cell holding ``\\r``,
which ``COPY`` writes as ``,"\\r"`` before the LF: the bytes ``,"\\r"\\n`` then occur at the
end of every row and nowhere else (inside a quoted cell every quote is doubled, so no quote
there is followed by CR and then by a quote and LF), and ``CopyLines`` replaces each with
CRLF. Counting them counts the rows. The tests compare both paths byte for byte.
"""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Iterable
from typing import Any

from jobrelay.exports.defang import FAST_HIGH, FAST_LOW, SEPARATOR_PATTERN, defang

COLUMNS = ("entry_id", "booked_on", "description", "counterparty", "amount", "currency")
HEADER = (",".join(COLUMNS) + "\r\n").encode()
ROW_END_CELL = "\r"  # the extra cell of every COPY row
_COPY_ROW_END = b',"\r"\n'
_LINE_END = b"\r\n"
_LOW, _HIGH = chr(FAST_LOW), chr(FAST_HIGH)
_SEPARATOR = re.compile(SEPARATOR_PATTERN).search


def python_lines(rows: Iterable[tuple[Any, ...]]) -> bytes:
    """Raw rows ``(id, booked_on, description, counterparty, amount, currency)`` (NULL
    text as ``""``) as the format's lines: text defanged, ``booked_on`` as SQLite stores
    it (ISO text) or ``isoformat()``, amounts ``f"{amount:.2f}"``, NULL as an empty cell."""
    buffer = io.StringIO()
    csv.writer(buffer, lineterminator="\r\n").writerows(
        (
            entry_id,
            booked if booked is None or booked.__class__ is str else booked.isoformat(),
            # defang's own first test, inline: most cells need no call at all
            description
            if _LOW < description[:1] < _HIGH and not _SEPARATOR(description)
            else defang(description),
            counterparty
            if _LOW < counterparty[:1] < _HIGH and not _SEPARATOR(counterparty)
            else defang(counterparty),
            None if amount is None else f"{amount:.2f}",
            currency
            if _LOW < currency[:1] < _HIGH and not _SEPARATOR(currency)
            else defang(currency),
        )
        for entry_id, booked, description, counterparty, amount, currency in rows
    )
    return buffer.getvalue().encode()


class CopyLines:
    """Turns ``COPY``'s chunks into the format's lines: whole rows only, CRLF line ends."""

    def __init__(self) -> None:
        self._tail = b""
        self.rows = 0

    def feed(self, chunk: bytes) -> bytes:
        """The complete rows so far; a row cut between two chunks waits for the next one."""
        data = self._tail + chunk if self._tail else chunk
        end = data.rfind(_COPY_ROW_END)
        if end < 0:
            self._tail = data
            return b""
        end += len(_COPY_ROW_END)
        self._tail = data[end:]
        whole = data[:end]
        self.rows += whole.count(_COPY_ROW_END)
        return whole.replace(_COPY_ROW_END, _LINE_END)

    def finish(self) -> None:
        """Bytes after the last row end are not a row: a COPY that stopped mid-row."""
        if self._tail:
            raise ValueError(f"COPY ended inside a row ({len(self._tail)} bytes left over)")
