"""The order of a job's timeline: by time, and each hand-off after what it handed over.

Events come from several processes, each stamping them with its own clock: the API, the
relay, the workers, the operators. Sorting by time (ties by write order) is right as long as
those clocks agree. Where they disagree, the one order that matters most can come out
backwards: a worker whose host clock is behind stamps its ``claimed`` before the relay's
``published`` of the very message it consumed. That reads as work done on a message that
had not been sent yet, and is never what happened.

So the order is causal where the timeline knows the cause: every event a delivery wrote
(``claimed``, ``duplicate_acked``, a quarantine on delivery, …) names the outbox row its
message was sent from (``outboxId``), and comes after that row's ``published``. When the
clocks put it earlier, the ``published`` is moved up to just before it: the attempt's own
events keep their order (they share one clock), and only the hand-off moves. Everything
else keeps the time order. The relay stamps ``published`` with the instant it took the row
to send, by the store's clock, so with agreeing clocks nothing needs to move.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, TypeVar

PUBLISHED = "published"


class TimelineEvent(Protocol):
    @property
    def kind(self) -> str: ...

    @property
    def detail(self) -> Mapping[str, Any]: ...


E = TypeVar("E", bound=TimelineEvent)


def message_of(event: TimelineEvent) -> int | None:
    """The outbox row an event is about: the one published, or the one delivered."""
    value = event.detail.get("outboxId")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def causal_order(events: Sequence[E]) -> list[E]:
    """``events`` (in time order) with each message's ``published`` before its deliveries.

    Stable: nothing moves unless a delivery's event came before its message's ``published``,
    and then only that ``published`` moves (up to the first such event).
    """
    published: dict[int, int] = {}  # outbox row -> index of its published event
    for index, event in enumerate(events):
        ref = message_of(event)
        if event.kind == PUBLISHED and ref is not None:
            published.setdefault(ref, index)
    ordered: list[E] = []
    moved: set[int] = set()
    for index, event in enumerate(events):
        if index in moved:
            continue
        ref = message_of(event)
        if event.kind != PUBLISHED and ref is not None:
            cause = published.get(ref)
            if cause is not None and cause > index and cause not in moved:
                ordered.append(events[cause])
                moved.add(cause)
        ordered.append(event)
    return ordered


__all__ = ["PUBLISHED", "TimelineEvent", "causal_order", "message_of"]
