"""The SSE stream's cursor (``api.event_stream.Resume``): a reconnecting client gets exactly
the events it had not received, whatever order they were sent in (found in review: with the
row id as a high-water mark, a ``published`` sent before an earlier-numbered ``claimed`` made
a resume after it skip the ``claimed``)."""

from __future__ import annotations

import pytest

from jobrelay.api.event_stream import Resume


def test_a_resume_after_any_frame_gets_exactly_the_events_not_yet_sent() -> None:
    order = [1, 3, 2, 4]  # published (3) moved up before the claimed (2) it caused
    known = set(order)
    cursor = Resume()
    for index, event_id in enumerate(order):
        cursor = cursor.after_sending(event_id, known)
        again = Resume.parse(str(cursor))
        assert again == cursor
        assert [i for i in order if not again.has(i)] == order[index + 1 :], (index, str(again))
    assert str(cursor) == "4"


def test_the_cursor_says_what_was_sent_past_a_gap() -> None:
    cursor = Resume().after_sending(1, {1, 2, 3}).after_sending(3, {1, 2, 3})
    assert str(cursor) == "1:3"
    assert not cursor.has(2) and cursor.has(3)


@pytest.mark.parametrize("header", [None, "", "x", "-1", "5:3", "5:a", "1:2,x"])
def test_a_header_that_is_not_a_cursor_starts_from_the_beginning(header: str | None) -> None:
    assert Resume.parse(header) is None
