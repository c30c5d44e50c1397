"""The topology's names: the default queue keeps its old ones, a named queue gets its own."""

from __future__ import annotations

import pytest

from jobrelay.domain.queues import destination, parse_destination
from jobrelay.storage.records import retry_destination, work_destination
from jobrelay.transport.rabbitmq import retry_queue_arguments
from jobrelay.transport.topology import Topology, retry_queue, work_queue


def test_destinations_map_both_ways() -> None:
    cases = {
        ("default", None): "work",
        ("default", 5): "retry.5s",
        ("images", None): "work.images",
        ("images", 5): "retry.images.5s",
        ("5s", 1): "retry.5s.1s",
    }
    for (queue, delay), expected in cases.items():
        assert destination(queue, delay) == expected
        assert parse_destination(expected) == (queue, delay)
    assert (work_destination("images"), retry_destination(30, "images")) == (
        "work.images",
        "retry.images.30s",
    )
    for bad in ("", "nope", "work.", "work.default", "retry.0s", "retry.default.5s", "work.A"):
        assert parse_destination(bad) is None, bad


def test_names_and_routes() -> None:
    topology = Topology(retry_delays=(30, 5, 5), delivery_limit=5, queues=("images", "default"))
    assert topology.queues == ("default", "images")
    assert (work_queue(), work_queue("images")) == ("jobrelay.work", "jobrelay.work.images")
    assert retry_queue(5, "images") == "jobrelay.retry.images.5s"
    assert topology.names() == [
        "jobrelay.work",
        "jobrelay.retry.5s",
        "jobrelay.retry.30s",
        "jobrelay.work.images",
        "jobrelay.retry.images.5s",
        "jobrelay.retry.images.30s",
        "jobrelay.quarantine",
    ]
    for routed in ("work", "retry.5s", "work.images", "retry.images.30s"):
        assert topology.routes(routed), routed
    for unrouted in ("work.videos", "retry.images.7s", "retry.7s", "quarantine"):
        assert not topology.routes(unrouted), unrouted
    assert retry_queue_arguments(5, "images")["x-dead-letter-routing-key"] == "work.images"
    assert retry_queue_arguments(5)["x-dead-letter-routing-key"] == "work"
    with pytest.raises(ValueError):
        Topology(retry_delays=(5,), delivery_limit=5, queues=("Bad.Name",))


def test_an_asked_retry_delay_rounds_up_to_a_declared_tier_or_is_exact_locally() -> None:
    rabbit = Topology(retry_delays=(30, 5), delivery_limit=5)
    assert [rabbit.retry_delay(s) for s in (0.2, 5, 5.1, 30, 31, 3600)] == [5, 5, 30, 30, 30, 30]
    local = Topology(retry_delays=(5, 30), delivery_limit=5, dynamic_delays=True)
    assert [local.retry_delay(s) for s in (0.2, 2.5, 42, 3600)] == [1, 3, 42, 3600]
    assert local.routes("retry.42s") and not rabbit.routes("retry.42s")
