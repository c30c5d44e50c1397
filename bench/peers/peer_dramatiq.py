"""The Dramatiq peer: the status-row body as an actor on RabbitMQ, with publisher confirms.

Durability, as a careful Dramatiq user would set it:

- publishing: ``RabbitmqBroker(confirm_delivery=True)``, so every ``send`` waits for the
  broker's confirm and is published ``mandatory`` (an unroutable message raises); Dramatiq
  always publishes ``delivery_mode=2`` (persistent).
- queues: durable, and CLASSIC by default. Dramatiq declares its queues itself (the queue,
  its ``.DQ`` delay queue and ``.XQ`` dead-letter queue) and has no public option for queue
  arguments, so it cannot be told to declare quorum queues. ``--queue-type quorum`` (env
  ``PEER_QUEUE_TYPE``) overrides the broker's private ``_build_queue_arguments`` to add
  ``x-queue-type: quorum`` to the queue and its delay queue, to see what quorum queues cost
  it; that relies on a private method and is not the default.
- consuming: manual acks, each message acked only after the actor returned (a failure is
  retried through the delay queue by the default Retries middleware); per-consumer prefetch
  of 2 x threads (Dramatiq's default).

Worker processes: ``dramatiq --processes P --threads C`` (one supervisor forking P worker
processes), each ready when the ``after_worker_boot`` hook runs, after its consumer and
worker threads started; its pool is opened in ``before_worker_boot``, so connecting is
start-up, not drain. Log level: Dramatiq's default (INFO, which logs nothing per message).
"""

from __future__ import annotations

import os
import sys
from importlib import metadata
from typing import Any

import dramatiq
import status
from dramatiq.brokers.rabbitmq import RabbitmqBroker
from dramatiq.middleware import Middleware

QUEUE = "peer"
DEFAULT_QUEUE_TYPE = "classic"
VERSION = metadata.version("dramatiq")
PACKAGES = {name: metadata.version(name) for name in ("dramatiq", "pika")}


class QuorumRabbitmqBroker(RabbitmqBroker):
    """Dramatiq's broker with ``x-queue-type: quorum`` on its queue and delay queue."""

    def _build_queue_arguments(self, queue_name: str) -> dict[str, Any]:
        arguments: dict[str, Any] = super()._build_queue_arguments(queue_name)
        return arguments | {"x-queue-type": "quorum"}


class ReadyMarker(Middleware):
    """Open the body's pool before the worker starts; mark the process ready once it has."""

    def before_worker_boot(self, broker: dramatiq.Broker, worker: dramatiq.Worker) -> None:
        BODY.pool()

    def after_worker_boot(self, broker: dramatiq.Broker, worker: dramatiq.Worker) -> None:
        status.mark_ready()

    def after_worker_shutdown(self, broker: dramatiq.Broker, worker: dramatiq.Worker) -> None:
        BODY.close()


def queue_type() -> str:
    return os.environ.get("PEER_QUEUE_TYPE") or DEFAULT_QUEUE_TYPE


def durability() -> dict[str, str]:
    return {
        "publish": "confirm_delivery=True (publisher confirms, mandatory, one send at a time)",
        "delivery_mode": "2 (persistent)",
        "queue": f"durable {queue_type()}"
        + (" (private _build_queue_arguments override)" if queue_type() == "quorum" else ""),
        "ack": "manual, after the actor returns; prefetch 2 x threads per consumer",
    }


BODY = status.SyncBody()
_broker_class = QuorumRabbitmqBroker if queue_type() == "quorum" else RabbitmqBroker
broker = _broker_class(url=os.environ["PEER_AMQP_URL"], confirm_delivery=True)
if status.in_worker():
    broker.add_middleware(ReadyMarker())
dramatiq.set_broker(broker)


@dramatiq.actor(queue_name=QUEUE)
def peer_job(job_id: str) -> None:
    BODY.run(job_id)


def prepare() -> None:
    """Nothing: Dramatiq declares its queues on the first ``send``."""


def enqueue(job_ids: list[str]) -> None:
    for job_id in job_ids:
        peer_job.send(job_id)
    broker.close()


def worker_commands(processes: int, concurrency: int) -> list[tuple[str, list[str]]]:
    argv = [sys.executable, "-m", "dramatiq", "--processes", str(processes)]
    return [("supervisor", [*argv, "--threads", str(concurrency), "peer_dramatiq"])]
