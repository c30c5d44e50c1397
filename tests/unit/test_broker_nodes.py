"""Several broker URLs are one cluster: parsing, redaction, where the management API is, and
the soak's node faults in the plan."""

from __future__ import annotations

import pytest

from jobrelay.chaos.plan import PROFILES, make_plan
from jobrelay.errors import ConfigError
from jobrelay.settings import load_settings, redact_url
from jobrelay.transport.rabbit_management import Placement, management_urls, render
from jobrelay.transport.rabbit_nodes import split_broker_urls
from jobrelay.transport.rabbitmq import retry_queue_arguments, work_queue_arguments
from jobrelay.transport.topology import Topology

NODES = "amqp://u:secret@10.0.0.1:5672/jr, amqp://u:secret@10.0.0.2:5672/jr,amqp://u:secret@h3/jr"


def test_comma_separated_urls_are_the_nodes_of_one_cluster() -> None:
    assert split_broker_urls(NODES) == [
        "amqp://u:secret@10.0.0.1:5672/jr",
        "amqp://u:secret@10.0.0.2:5672/jr",
        "amqp://u:secret@h3/jr",
    ]
    settings = load_settings(broker_url=NODES)
    assert settings.broker_url == ",".join(split_broker_urls(NODES))
    assert "secret" not in redact_url(settings.broker_url)
    assert redact_url(settings.broker_url).count(":***@") == 3


@pytest.mark.parametrize(
    "value",
    [
        "amqp://u:p@h1/jr,kafka://h2",  # one bad node
        "amqp://u:p@h1/jr,amqp://u:p@h2/other",  # another vhost: another broker
        "amqp://u:p@h1/jr,amqp://v:p@h2/jr",  # another user
        " , ",
    ],
)
def test_nodes_that_are_not_one_broker_are_refused(value: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(broker_url=value)
    assert caught.value.variable == "JOBRELAY_BROKER_URL"


def test_the_management_api_is_each_node_on_15672_unless_configured() -> None:
    assert management_urls(NODES, None) == [
        "http://10.0.0.1:15672",
        "http://10.0.0.2:15672",
        "http://h3:15672",
    ]
    assert management_urls(NODES, "https://mgmt.example/ ,http://m2:15672") == [
        "https://mgmt.example",
        "http://m2:15672",
    ]
    with pytest.raises(ConfigError) as caught:
        load_settings(broker_management_url="ftp://x")
    assert caught.value.variable == "JOBRELAY_BROKER_MANAGEMENT_URL"


def test_every_queue_asks_for_the_configured_quorum_group() -> None:
    topology = Topology(retry_delays=(5,), delivery_limit=5, quorum_size=5)
    assert work_queue_arguments(topology)["x-quorum-initial-group-size"] == 5
    assert retry_queue_arguments(5, quorum_size=5)["x-quorum-initial-group-size"] == 5
    assert load_settings().quorum_group_size == 3
    with pytest.raises(ConfigError):
        load_settings(quorum_group_size="0")


def test_placements_render_leader_and_online_members() -> None:
    table = render([Placement("jobrelay.work", "n1", ("n1", "n2", "n3"), ("n1", "n3"))])
    assert "jobrelay.work  n1  n1*, n2, n3*" in table
    assert render("unknown: why") == "unknown: why"


def test_node_faults_come_in_order_and_replace_the_broker_restart() -> None:
    workers, relays = ("w1", "w2", "w3", "w4"), ("r1", "r2", "r3")
    full = make_plan(1, 100, 3, PROFILES["full"], workers, relays, "a1,a2", rabbit_nodes=3)
    kinds = [(f.kind, f.target) for f in full.faults if f.kind.startswith("node_")]
    assert kinds == [("node_stop", "leader"), ("node_start", "stopped"), ("node_stop", "other")]
    assert full.faults[0].kind != "node_stop"
    assert not any(f.kind == "rabbitmq_restart" for f in full.faults)
    assert any(f.kind == "postgres_restart" for f in full.faults)
    short = make_plan(1, 100, 3, PROFILES["short"], workers, relays, "a1,a2", rabbit_nodes=3)
    assert [f.kind for f in short.faults if f.kind.startswith("node_")] == ["node_stop"]
    plain = make_plan(1, 100, 3, PROFILES["full"], workers, relays)
    assert not any(f.kind.startswith("node_") for f in plain.faults)
    assert any(f.kind == "rabbitmq_restart" for f in plain.faults)


async def test_unacked_reads_the_management_api_and_says_none_when_it_is_down(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In flight on RabbitMQ is the management API's ``messages_unacknowledged``; a node
    without the plugin makes it unknown (None), never 0."""
    import httpx

    from jobrelay.transport import rabbit_management

    seen: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(str(request.url))
        if request.url.host == "down":
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(200, json={"messages_unacknowledged": 7})

    real = httpx.AsyncClient

    def client(**kwargs: object) -> httpx.AsyncClient:
        return real(transport=httpx.MockTransport(answer), **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(rabbit_management.httpx, "AsyncClient", client)
    url = "amqp://u:p@down:5672/jobs,amqp://u:p@up:5672/jobs"
    assert await rabbit_management.unacked(url, None, ["jobrelay.work"]) == {"jobrelay.work": 7}
    assert seen[-1] == "http://up:15672/api/queues/jobs/jobrelay.work"
    assert await rabbit_management.unacked("amqp://u:p@down:5672/", None, ["q"]) is None
