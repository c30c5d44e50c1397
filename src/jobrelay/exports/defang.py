"""Spreadsheet formula defanging (OWASP "CSV injection"), as ONE rule in two languages.

A description typed as ``=HYPERLINK(...)`` must open as text, not run: a cell that starts
with a formula character, a tab or a line break, or has a formula character after leading
whitespace or invisible characters, gets a ``'`` in front. A spreadsheet set to split on
``;`` (the default where the decimal separator is a comma) or on tabs also starts a new cell
inside ours, and reads the CSV's quotes only at the start of a cell, so ``Refund;=cmd|…``
would be a formula there: after every ``;``, tab or line break that is followed (through
spaces and invisible characters) by a formula character, a ``'`` goes in too. ``defang`` is
the rule in Python
(the SQLite export, and the reference); ``PG_PATTERN`` with the ``FAST_*`` bounds is the
same rule as a PostgreSQL regular expression, so the PostgreSQL export can defang inside
``COPY`` without a line of Python per row. Both are built from the character sets below,
and the tests hold them equal on generated strings.
"""

from __future__ import annotations

import re

# A spreadsheet skips these before it decides whether a cell is a formula, so "  =1+1" or
# "\ufeff=1+1" is as dangerous as "=1+1". SPACES is exactly what ``str.isspace`` (and so
# ``str.lstrip()``) treats as whitespace: listed, because PostgreSQL's ``\s`` is narrower
# (ASCII only) and the SQL rule must skip the same characters. A unit test enumerates them.
SPACES = (
    "\t\n\x0b\x0c\r\x1c\x1d\x1e\x1f \x85\xa0\u1680"
    "\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a"
    "\u2028\u2029\u202f\u205f\u3000"
)
# The zero-width characters and the byte-order mark (not whitespace to Python).
INVISIBLE = "\u200b\u200c\u200d\u2060\ufeff"
# The ASCII operators and their full-width forms, which some spreadsheets read as them.
FORMULA_CHARS = "=+-@\uff1d\uff0b\uff0d\uff20"
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r", "\n")
# Where a spreadsheet may start a new cell inside one of ours.
SEPARATORS = ";\t\r\n"
_INVISIBLE = frozenset(INVISIBLE)
_FORMULA = frozenset(FORMULA_CHARS)

# Every character the rule looks at first is at most "@" or at least U+0085: a cell whose
# first character lies strictly between them (letters, digits above "@", most text) and
# that holds no separator is never defanged, which spares almost every cell the full check,
# in Python and in SQL.
FAST_LOW = ord("@")
FAST_HIGH = 0x85
_LOW, _HIGH = chr(FAST_LOW), chr(FAST_HIGH)


def _bracket(chars: str) -> str:
    # Every character as a \uXXXX escape: no character is special inside the brackets then
    # (read the same by Python's re and PostgreSQL's regular expressions).
    return "".join(f"\\u{ord(c):04x}" for c in sorted(set(chars)))


# A separator followed, through skipped characters that are not separators themselves, by
# a formula character; the quote goes after the separator (``\1'``), so the last separator
# before the formula is the one that gets it and no split of the cell starts with it.
# Python's ``re`` and PostgreSQL's ARE read this pattern alike (the tests hold them equal).
_SKIPPED_INSIDE = "".join(c for c in SPACES + INVISIBLE if c not in SEPARATORS)
SEPARATED_PATTERN = (
    f"([{_bracket(SEPARATORS)}])(?=[{_bracket(_SKIPPED_INSIDE)}]*[{_bracket(FORMULA_CHARS)}])"
)
SEPARATED_REPLACEMENT = "\\1'"
SEPARATOR_PATTERN = f"[{_bracket(SEPARATORS)}]"
_SEPARATED = re.compile(SEPARATED_PATTERN)
_HAS_SEPARATOR = re.compile(SEPARATOR_PATTERN).search


def defang(cell: str) -> str:
    """Prefix a quote so spreadsheets show the text instead of evaluating it: a cell that
    starts with a formula character, a tab or a line break, or has a formula character after
    leading spaces or invisible characters; and put one after each separator (``;``, tab,
    line break) that a formula character follows."""
    separated = _HAS_SEPARATOR(cell) is not None
    if _LOW < cell[:1] < _HIGH and not separated:
        return cell
    inner = _SEPARATED.sub(SEPARATED_REPLACEMENT, cell) if separated else cell
    return "'" + inner if _starts_formula(cell) else inner


def _starts_formula(cell: str) -> bool:
    if _LOW < cell[:1] < _HIGH:
        return False
    if cell.startswith(_FORMULA_START):
        return True
    visible = cell.lstrip()
    while visible and visible[0] in _INVISIBLE:
        visible = visible[1:].lstrip()
    return bool(visible) and visible[0] in _FORMULA


# The same rule as a PostgreSQL ARE (advanced regular expression): a tab or line break
# first, or any run of skipped characters followed by a formula character. ``^`` anchors at
# the start of the value (PostgreSQL's regexes are not newline-sensitive by default).
PG_PATTERN = f"^(?:[\\t\\n\\r]|[{_bracket(SPACES + INVISIBLE)}]*[{_bracket(FORMULA_CHARS)}])"
