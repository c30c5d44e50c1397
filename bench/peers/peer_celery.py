"""The Celery peer: the status-row body as a task on RabbitMQ (py-amqp), acked late.

Durability, as the issue asks and Celery documents it:

- publishing: ``broker_transport_options={"confirm_publish": True}``, so every
  ``apply_async`` waits for the broker's confirm; ``task_default_delivery_mode="persistent"``
  (``delivery_mode=2``, Celery's default, set explicitly).
- queue: durable QUORUM, declared through Celery's own queue arguments
  (``Queue(..., queue_arguments={"x-queue-type": "quorum"})``); Celery then detects the
  quorum queue and uses per-consumer QoS instead of the global QoS quorum queues reject.
  ``--queue-type classic`` (env ``PEER_QUEUE_TYPE``) declares it classic instead.
- consuming: ``task_acks_late=True`` (acked after the task returns),
  ``task_reject_on_worker_lost=True``, ``task_acks_on_failure_or_timeout`` left at its
  default; prefetch ``worker_prefetch_multiplier`` (default 4) x concurrency per worker.
- no result backend (``task_ignore_result``): the result key goes to the status row.

Worker processes: ``celery worker --pool threads -c C``, one per process in the budget
(a thread-pool worker is one process), ``--without-gossip --without-mingle
--without-heartbeat`` (cluster chatter, not delivery; durability is unaffected), at Celery's
default log level (WARNING: nothing per task). A worker is ready at Celery's
``worker_ready`` signal; its pool is opened at ``worker_init``, before the consumer starts.
"""

from __future__ import annotations

import os
import sys
from importlib import metadata
from typing import Any

import status
from celery import Celery
from celery.signals import worker_init, worker_ready, worker_shutdown
from kombu import Exchange, Queue

QUEUE = "peer"
DEFAULT_QUEUE_TYPE = "quorum"
VERSION = metadata.version("celery")
PACKAGES = {name: metadata.version(name) for name in ("celery", "kombu", "amqp")}


def queue_type() -> str:
    return os.environ.get("PEER_QUEUE_TYPE") or DEFAULT_QUEUE_TYPE


def durability() -> dict[str, str]:
    return {
        "publish": "broker_transport_options confirm_publish=True (one publish at a time)",
        "delivery_mode": "2 (persistent, task_default_delivery_mode)",
        "queue": f"durable {queue_type()} (queue_arguments x-queue-type)",
        "ack": "task_acks_late=True, task_reject_on_worker_lost=True; prefetch 4 x concurrency",
    }


BODY = status.SyncBody()
app = Celery("peer_celery", broker=os.environ["PEER_AMQP_URL"])
app.conf.update(
    broker_transport_options={"confirm_publish": True},
    broker_connection_retry_on_startup=True,
    task_queues=[
        Queue(
            QUEUE,
            Exchange(QUEUE, type="direct", durable=True),
            routing_key=QUEUE,
            durable=True,
            queue_arguments={"x-queue-type": queue_type()},
        )
    ],
    task_default_queue=QUEUE,
    task_default_exchange=QUEUE,
    task_default_routing_key=QUEUE,
    task_default_delivery_mode="persistent",
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    task_ignore_result=True,
    task_serializer="json",
    accept_content=["json"],
)


@app.task(name="peer_job")
def peer_job(job_id: str) -> None:
    BODY.run(job_id)


@worker_init.connect
def _open_pool(**_: Any) -> None:
    BODY.pool()


@worker_ready.connect
def _ready(**_: Any) -> None:
    status.mark_ready()


@worker_shutdown.connect
def _close_pool(**_: Any) -> None:
    BODY.close()


def prepare() -> None:
    """Nothing: the first publish declares the exchange, the queue and its binding."""


def enqueue(job_ids: list[str]) -> None:
    with app.producer_or_acquire() as producer:
        for job_id in job_ids:
            peer_job.apply_async(args=[job_id], producer=producer)


def worker_commands(processes: int, concurrency: int) -> list[tuple[str, list[str]]]:
    argv = [sys.executable, "-m", "celery", "-A", "peer_celery", "worker"]
    flags = ["--pool", "threads", "--concurrency", str(concurrency), "--queues", QUEUE]
    quiet = ["--without-gossip", "--without-mingle", "--without-heartbeat"]
    return [
        (f"worker-{i}", [*argv, *flags, *quiet, "--hostname", f"peer{i}@%h"])
        for i in range(1, processes + 1)
    ]
