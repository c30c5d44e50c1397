"""The export's CSV format on its own: the character sets of the defanging, and the turning
of COPY's chunks into the format's lines."""

from __future__ import annotations

import csv
import io
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jobrelay.exports import csv_format, defang


def test_spaces_are_exactly_what_python_strips() -> None:
    every = "".join(chr(c) for c in range(0x110000) if chr(c).isspace())
    assert every == defang.SPACES


def test_every_character_the_rule_looks_at_is_outside_the_fast_range() -> None:
    looked_at = defang.SPACES + defang.INVISIBLE + defang.FORMULA_CHARS + "\t\r\n"
    inside = [c for c in looked_at if defang.FAST_LOW < ord(c) < defang.FAST_HIGH]
    assert inside == []


def test_pg_pattern_read_by_python_regexes_agrees_on_the_sets() -> None:
    # Python's re reads \\uXXXX escapes as PostgreSQL's AREs do: a cheap first check of
    # the pattern's brackets (the database check is tests/integration/test_export_paths.py).
    pattern = re.compile(defang.PG_PATTERN)
    for c in defang.SPACES + defang.INVISIBLE:
        assert pattern.match(c + "=1")
        assert bool(pattern.match(c + "x")) is (c in "\t\r\n")  # those alone suffice
    for c in defang.FORMULA_CHARS:
        assert pattern.match(c)


def _copy_rows(rows: list[list[str]]) -> bytes:
    """What ``COPY … WITH CSV`` sends for ``rows`` plus the row-end cell: PostgreSQL quotes
    a cell holding a comma, a quote, CR or LF, as Python's writer does with a CRLF
    terminator, but ends each row with a bare LF (empty cells stand for NULL, as the
    export sends them)."""
    sent = []
    for row in rows:
        buffer = io.StringIO()
        csv.writer(buffer, lineterminator="\r\n").writerow([*row, csv_format.ROW_END_CELL])
        sent.append(buffer.getvalue().removesuffix("\r\n") + "\n")
    return "".join(sent).encode()


def _python_rows(rows: list[list[str]]) -> bytes:
    buffer = io.StringIO()
    csv.writer(buffer, lineterminator="\r\n").writerows(rows)
    return buffer.getvalue().encode()


_cell = st.text(st.sampled_from(list(",\"\r\n'ab é")), max_size=5)


@given(
    rows=st.lists(st.lists(_cell, min_size=2, max_size=2), min_size=1, max_size=8),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=6),
)
def test_copy_lines_are_the_python_lines_however_the_chunks_fall(
    rows: list[list[str]], cuts: list[int]
) -> None:
    sent = _copy_rows(rows)
    lines = csv_format.CopyLines()
    out = b""
    start = 0
    for cut in sorted({min(c, len(sent)) for c in cuts}):
        out += lines.feed(sent[start:cut])
        start = cut
    out += lines.feed(sent[start:])
    lines.finish()
    assert lines.rows == len(rows)
    assert out == _python_rows(rows)


def test_a_copy_that_stops_inside_a_row_is_an_error() -> None:
    lines = csv_format.CopyLines()
    assert lines.feed(b'1,a,"\r"\n2,b') == b"1,a\r\n"
    with pytest.raises(ValueError, match="inside a row"):
        lines.finish()


def test_python_lines_defang_and_format() -> None:
    from datetime import date
    from decimal import Decimal

    data = csv_format.python_lines(
        [
            (1, "2020-05-01", "=1+1", "a,b", 12.5, "EUR"),
            (2, date(2020, 5, 2), "", 'say "x"', Decimal("-0.01"), "\u00a0@"),
            (3, None, "line\nbreak", "", None, ""),
        ]
    )
    assert data == (
        b'1,2020-05-01,\'=1+1,"a,b",12.50,EUR\r\n'
        b'2,2020-05-02,,"say ""x""",-0.01,\'\xc2\xa0@\r\n'
        b'3,,"line\nbreak",,,\r\n'
    )


# --- spreadsheets that split on ";" or tabs (issue 25, item 6) ------------------------------

_SPLITTERS = (";", "\t", "\n", "\r")


def _formula_parts(cell: str) -> list[str]:
    """The pieces a spreadsheet that splits on ``;``, a tab or a line break (ignoring the
    CSV's quotes, which only count at the start of a cell) would read as formulas."""
    found = []
    for splitter in _SPLITTERS:
        for part in cell.split(splitter)[1:]:
            visible = part.lstrip()
            while visible and visible[0] in defang.INVISIBLE:
                visible = visible[1:].lstrip()
            if visible[:1] in set(defang.FORMULA_CHARS) and visible:
                found.append(part)
    return found


def test_a_formula_after_a_semicolon_tab_or_line_break_is_defanged() -> None:
    assert defang.defang("Refund;=cmd|' /C calc'!A0") == "Refund;'=cmd|' /C calc'!A0"
    assert defang.defang("Refund\t=cmd") == "Refund\t'=cmd"
    assert defang.defang("Refund;\t @SUM(A1)") == "Refund;\t' @SUM(A1)"
    assert defang.defang("a\r\n+1") == "a\r\n'+1"
    assert defang.defang("Refund; 20 EUR") == "Refund; 20 EUR"
    # The whole-cell rule is decided on the cell as it came: both apply.
    assert defang.defang("\t;=1") == "'\t;'=1"


@given(st.text(st.sampled_from([*_SPLITTERS, " ", "\u00a0", "\ufeff", "=", "@", "a", "'"])))
def test_no_split_of_a_defanged_cell_reads_as_a_formula(cell: str) -> None:
    assert _formula_parts(defang.defang(cell)) == []


def test_python_lines_defang_after_a_semicolon() -> None:
    data = csv_format.python_lines([(1, "2020-05-01", "Refund;=cmd", "x\t-1", 1, "EUR;@x")])
    assert data == b"1,2020-05-01,Refund;'=cmd,x\t'-1,1.00,EUR;'@x\r\n"
