"""Where an attempt uploads the result meant for a key (issue 34, item 2): beside it, the
extension kept (the content type and a download's name follow it), one key per attempt."""

from __future__ import annotations

from jobrelay.results.base import attempt_key


def test_the_attempt_goes_before_the_extension() -> None:
    assert attempt_key("exports/acme/j.csv", 2) == "exports/acme/j.attempt-2.csv"
    assert attempt_key("a/b.tar.gz", 1) == "a/b.tar.attempt-1.gz"


def test_a_key_without_an_extension_gets_it_at_the_end() -> None:
    assert attempt_key("exports/acme/j", 3) == "exports/acme/j.attempt-3"
    assert attempt_key(".hidden", 1) == ".hidden.attempt-1"


def test_no_two_stagings_without_an_attempt_share_a_key() -> None:
    first, second = attempt_key("r/x.csv", None), attempt_key("r/x.csv", None)
    assert first != second and first.startswith("r/x.staged-") and first.endswith(".csv")
