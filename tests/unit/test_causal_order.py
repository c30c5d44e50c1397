"""The timeline's causal order (domain/timeline.py): a message's ``published`` comes before
whatever its deliveries wrote, and nothing else moves."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from jobrelay.domain.messages import OUTBOX_ID_HEADER, outbox_id_of
from jobrelay.domain.timeline import causal_order


@dataclass(frozen=True)
class Ev:
    kind: str
    detail: dict[str, Any] = field(default_factory=dict)


def pub(ref: int) -> Ev:
    return Ev("published", {"outboxId": ref})


def got(kind: str, ref: int | None = None) -> Ev:
    return Ev(kind, {} if ref is None else {"outboxId": ref})


def test_time_order_is_kept_when_every_publish_already_comes_first() -> None:
    events = [got("accepted"), pub(1), got("claimed", 1), got("result_saved"), got("ack_sent")]
    assert causal_order(events) == events


def test_a_late_published_moves_up_to_its_first_delivery_and_only_it_moves() -> None:
    events = [
        got("accepted"),
        got("claimed", 1),
        got("retry_scheduled"),
        got("claimed", 2),
        got("result_saved"),
        got("duplicate_acked", 1),
        pub(1),
        pub(2),
        pub(3),  # a message nobody has received yet stays where its time puts it
    ]
    assert causal_order(events) == [
        got("accepted"),
        pub(1),
        got("claimed", 1),
        got("retry_scheduled"),
        pub(2),
        got("claimed", 2),
        got("result_saved"),
        got("duplicate_acked", 1),
        pub(3),
    ]


def test_deliveries_without_a_known_message_and_odd_values_change_nothing() -> None:
    events = [
        got("claimed"),  # written before deliveries named their message
        got("claimed", 9),  # its published was pruned or never recorded
        Ev("claimed", {"outboxId": True}),
        Ev("claimed", {"outboxId": "1"}),
        pub(1),
    ]
    assert causal_order(events) == events


def test_the_header_the_relay_sets_is_read_back_as_the_outbox_id() -> None:
    assert outbox_id_of({OUTBOX_ID_HEADER: "42"}) == 42
    assert outbox_id_of({OUTBOX_ID_HEADER: b"42"}) == 42
    assert outbox_id_of({OUTBOX_ID_HEADER: 42}) == 42  # a broker that typed the header
    for value in ("", "-1", "4 2", "٤٢", None, 42.0, True, -1):
        assert outbox_id_of({OUTBOX_ID_HEADER: value}) is None, value
    assert outbox_id_of({}) is None
