"""The job store: every query jobrelay runs against its own tables, each a named method.

One class for callers, assembled from one module per concept (``jobs``, ``claims``,
``outcomes``, ``cancels``, ``outbox``, ``events``, ``tokens``) over ``base`` (the engine, the
one clock, the driver and the SQL they share). Every state change is declared once
(``transitions``); what differs between the databases is in one driver each (``drivers``).
The records it reads and writes are in ``records``.

What code outside these classes may use of it is ``port.StorePort``; callers hold a store by
that type, and mypy checks there that this class still provides all of it.
"""

from __future__ import annotations

from jobrelay.storage.admission import AdmissionStore, Admitted
from jobrelay.storage.cancels import CancelsStore
from jobrelay.storage.events import EventsStore
from jobrelay.storage.jobs import JobsStore
from jobrelay.storage.outbox import OutboxStore
from jobrelay.storage.outcomes import Completed, OutcomesStore
from jobrelay.storage.records import (
    NOTIFY_CHANNEL,
    WORK_DESTINATION,
    Claim,
    Claimed,
    ClaimRequest,
    CompleteRequest,
    Completion,
    EventRecord,
    Fenced,
    JobRecord,
    NewJob,
    OutboxRow,
    PendingEvent,
    TokenRecord,
    aware_time,
    job_record,
    retry_destination,
)
from jobrelay.storage.tokens import TokensStore


class Store(
    JobsStore, OutcomesStore, AdmissionStore, CancelsStore, OutboxStore, EventsStore, TokensStore
):
    """All of the store; see the modules it is made of."""


__all__ = [
    "NOTIFY_CHANNEL",
    "WORK_DESTINATION",
    "Admitted",
    "Claim",
    "ClaimRequest",
    "Claimed",
    "CompleteRequest",
    "Completed",
    "Completion",
    "EventRecord",
    "Fenced",
    "JobRecord",
    "NewJob",
    "OutboxRow",
    "PendingEvent",
    "Store",
    "TokenRecord",
    "aware_time",
    "job_record",
    "retry_destination",
]
