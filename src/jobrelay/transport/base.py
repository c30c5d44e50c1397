"""The transport port: what the relay and the worker need from a broker, and nothing more.

Both adapters (RabbitMQ, and the database-backed local transport) are held to the same
contract by one test suite (tests/integration/test_transport_contract.py):

- ``publish`` returns only once the broker has taken responsibility for the message (a
  publisher confirm, or a committed row). An unknown destination raises ``PublishError``
  instead of being dropped: a confirm alone does not prove the message was routed.
- ``consume`` yields deliveries to one consumer at a time, at most ``prefetch`` unsettled.
- A delivery not settled when its consumer dies is delivered again, ``redelivered=True``.
- ``reject`` settles without requeue and sends the message to the quarantine queue.
- ``ack`` and ``reject`` return whether the settle was handed to the broker on the channel
  (or claim) the delivery came on. ``False``, never an exception, when that channel or claim
  was gone: the message is, or will be, delivered again. On RabbitMQ ``True`` only means the
  frame was written on the open channel (``basic.ack`` has no reply).
- ``release`` gives it back for redelivery now; it counts towards the delivery limit.
- Closing a ``consume()`` iterator gives back what it prefetched but never handed out
  *without* counting it towards the delivery limit (nobody started it); with
  ``keep_in_flight=True`` what was handed out stays settleable, with no deadline, until it
  is settled or the transport closes (a worker leaving a paused queue keeps its long jobs).
- Destinations ``retry.<n>s`` come back to the work queue after n seconds, and
  ``retry.Q.<n>s`` to the work queue of queue Q (``work.Q``): a retry returns to its queue.
- ``consume(prefetch, queue=Q)`` delivers only what was sent to Q.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from jobrelay.domain.queues import DEFAULT_QUEUE


@dataclass(frozen=True)
class OutgoingMessage:
    destination: str
    body: bytes
    headers: Mapping[str, str] = field(default_factory=dict)
    message_id: str | None = None


class Delivery(Protocol):
    @property
    def body(self) -> bytes: ...

    @property
    def headers(self) -> Mapping[str, object]: ...

    @property
    def redelivered(self) -> bool: ...

    @property
    def delivery_count(self) -> int:
        """How many times the broker has handed this message out before (0 the first time)."""
        ...

    async def ack(self) -> bool:
        """Settle for good: the message is done and is not delivered again.

        True when the ack was handed to the broker on the channel (RabbitMQ) or under the
        claim (local transport) this delivery came on. False, without raising, when it could
        not be: the channel had closed, so the broker has requeued the message or will
        (RabbitMQ); the claim on the row was lost, because its visibility timeout passed and
        another consumer claimed the row, or the row was given back (local). Either way the
        message is, or will be, delivered again. False also for a second settle of a delivery
        already settled: nothing is sent, and the first settle's outcome stands.

        What True proves differs. Local: the row was deleted in a committed transaction,
        under this delivery's claim (a claim past its visibility timeout still counts while
        no other consumer has taken the row). RabbitMQ: AMQP has no reply to ``basic.ack``,
        so True only means the frame was written to the connection on the still-open channel
        of this delivery. Should the connection drop before the broker processes it, the
        broker requeues the message and delivers it again: at-least-once.

        The local transport raises ``TransportError`` when the database write itself fails;
        the row then comes back after the visibility timeout.
        """
        ...

    async def reject(self) -> bool:
        """Settle without requeue: the message goes to the quarantine queue.

        Returns as ``ack`` does: True when the reject was handed to the broker on this
        delivery's channel or claim (local: the row moved to the quarantine queue in a
        committed transaction; RabbitMQ: the ``basic.reject`` frame, which has no broker reply
        either, was written on the still-open channel), False when it could not be and the
        message is, or will be, delivered again instead of quarantined.
        """
        ...

    def outcome_committed(self) -> None:
        """The job's outcome is committed; its settle follows. The local transport counts
        the delivery's prefetch slot free from here, so its consumer claims the next rows
        while the ack is written (the row stays claimed, renewed, until the ack). RabbitMQ's
        window is the broker's: it frees the slot at the ack, as before."""
        ...

    async def release(self) -> None:
        """Give the message back for redelivery now (nack with requeue).

        For a delivery the worker could not handle at all (the database was down, a bug):
        holding it unsettled would pin a prefetch slot until the consumer dies. Each release
        counts towards the delivery limit, so a message that always fails ends in quarantine.
        Returns nothing: when the channel or claim is already gone, the message comes back
        anyway.
        """
        ...


class Transport(Protocol):
    async def connect(self) -> None:
        """Connect and declare the topology idempotently."""
        ...

    async def close(self) -> None: ...

    async def ping(self) -> None:
        """Raise TransportError unless the broker answers."""
        ...

    async def publish(self, message: OutgoingMessage) -> None:
        """Return once confirmed; raise PublishError (nack, unroutable, timeout) otherwise."""
        ...

    def consume(
        self, prefetch: int, queue: str = DEFAULT_QUEUE, *, keep_in_flight: bool = False
    ) -> AsyncIterator[Delivery]:
        """Deliveries from ``queue``'s work queue until the iterator is closed.

        Each call is a consumer of its own (a channel on RabbitMQ) with its own prefetch; a
        queue not in the topology raises ``TransportError``. Closing the iterator returns the
        prefetched rest uncounted; ``keep_in_flight`` keeps the deliveries handed out
        settleable (RabbitMQ: their channel open; local: their claims renewed) until each is
        settled or the transport closes, instead of for a grace period only.
        """
        ...

    async def quarantine_depth(self) -> int:
        """Messages waiting in the quarantine queue (for operators and tests)."""
        ...

    async def work_ready(self) -> int:
        """Messages in the work queues not handed to any consumer yet (the backlog)."""
        ...


@dataclass(frozen=True)
class QueueStats:
    """One work queue as the broker sees it; ``None`` is "unknown", never a guess."""

    queue: str
    ready: int | None
    consumers: int | None
    in_flight: int | None


@runtime_checkable
class ReportsQueues(Protocol):
    """A transport that can say how deep each work queue is (both adapters; test fakes
    need not)."""

    async def queue_stats(self) -> list[QueueStats]: ...
