"""The operation port, and the registry the worker looks types up in.

An operation gets everything it may touch through ``OperationContext``; it never sees the
broker or the delivery, so it cannot ack early or publish behind the outbox's back. It must
be safe to run again for the same job: it writes its result under a key derived from the
job id, so a second run replaces the first instead of adding a second result.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

from jobrelay.observe.faults import Faults
from jobrelay.results.base import ResultStore
from jobrelay.storage.port import StorePort
from jobrelay.storage.store import JobRecord, NewJob

ProgressFn = Callable[[int, int], Awaitable[None]]


def _utc_now() -> datetime:
    return datetime.now(UTC)


class JobThread(Protocol):
    """What a ``def`` job's body needs of the thread it runs on (the worker's is
    ``worker.threads.ThreadSlot``): named here so that the library imports nothing of the
    worker."""

    async def run(self, job_id: str, body: Callable[[], Any]) -> Any: ...


@dataclass(frozen=True)
class OperationContext:
    job: JobRecord
    attempt: int
    store: StorePort
    results: ResultStore
    faults: Faults
    report_progress: ProgressFn
    # The runtime's clock, for times an operation writes (the effects ledger).
    clock: Callable[[], datetime] = _utc_now
    # Set when this attempt's lease is gone; the worker also cancels the operation then.
    lease_lost: asyncio.Event = field(default_factory=asyncio.Event)
    # The lease owner this attempt runs as: the effects ledger fences an effect on it (with
    # ``attempt``), so a context without one may skip a delivered effect but not start one.
    worker: str | None = None
    # A ``def`` job's thread, taken by the worker before the claim (``worker.threads``).
    thread: JobThread | None = None


@dataclass(frozen=True)
class OperationResult:
    result_key: str | None
    meta: dict[str, Any] = field(default_factory=dict)
    # Jobs to create in the same transaction that records this success (a notification).
    follow_ups: tuple[NewJob, ...] = ()
    # The value the job returned, as the JSON text stored (``storable.value_json``).
    value_json: str | None = None


class Operation(Protocol):
    type: str

    def validate(self, params: Mapping[str, Any]) -> None:
        """Raise PermanentError when the stored parameters cannot ever succeed (an app's
        ``JobDefinition`` raises ``InvalidParams``, naming each field, as its enqueue does)."""
        ...

    async def run(self, ctx: OperationContext) -> OperationResult: ...


class Registry:
    def __init__(self, operations: list[Operation]) -> None:
        self._by_type = {op.type: op for op in operations}

    @property
    def types(self) -> frozenset[str]:
        return frozenset(self._by_type)

    def get(self, job_type: str) -> Operation | None:
        return self._by_type.get(job_type)
