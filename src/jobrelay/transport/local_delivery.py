"""The local transport's deliveries and the doorbells that wake its idle consumers.

Split from ``transport.local`` by concept: what a consumer holds (one claimed row, settled
at most once) and how a publish in this process reaches its waiting consumers at once.
The claiming, renewing and settling SQL stays with the transport (``Settler``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Protocol

from jobrelay.storage import local_queue as q

log = logging.getLogger("jobrelay.transport.local")


class Settler(Protocol):
    """What a delivery asks of its transport (``LocalTransport``)."""

    async def _settle(self, claim: q.Claimed, *, reject: bool) -> bool: ...

    async def _release(self, claim: q.Claimed) -> None: ...

    def _committed(self, claim: q.Claimed) -> None: ...


_Waiter = tuple[asyncio.AbstractEventLoop, asyncio.Event]


class Doorbells:
    """Wakes this process's idle consumers of a database the moment a publish commits.

    Process-wide on purpose: in ``jobrelay up`` the relay and the worker may hold different
    transport objects on the same database. Other processes still find rows by polling.
    """

    def __init__(self) -> None:
        self._waiting: dict[str, set[_Waiter]] = {}

    def register(self, key: str, event: asyncio.Event) -> _Waiter:
        waiter = (asyncio.get_running_loop(), event)
        self._waiting.setdefault(key, set()).add(waiter)
        return waiter

    def unregister(self, key: str, waiter: _Waiter) -> None:
        waiting = self._waiting.get(key, set())
        waiting.discard(waiter)
        if not waiting:
            self._waiting.pop(key, None)

    def ring(self, key: str) -> None:
        current = asyncio.get_running_loop()
        for loop, event in tuple(self._waiting.get(key, ())):
            if loop is current:
                event.set()
            elif not loop.is_closed():
                loop.call_soon_threadsafe(event.set)


DOORBELLS = Doorbells()


class LocalDelivery:
    def __init__(self, transport: Settler, claim: q.Claimed) -> None:
        self._transport = transport
        self._claim = claim
        self._settled = False

    @property
    def body(self) -> bytes:
        return self._claim.body

    @property
    def headers(self) -> Mapping[str, object]:
        return self._claim.headers

    @property
    def redelivered(self) -> bool:
        return self._claim.delivery_count > 0

    @property
    def delivery_count(self) -> int:
        return self._claim.delivery_count

    async def ack(self) -> bool:
        return await self._settle(reject=False)

    async def reject(self) -> bool:
        return await self._settle(reject=True)

    def outcome_committed(self) -> None:
        if not self._settled:
            self._transport._committed(self._claim)

    async def release(self) -> None:
        if self._settled:
            log.warning("delivery already settled", extra={"event": "settle_ignored"})
            return
        self._settled = True
        await self._transport._release(self._claim)

    async def _settle(self, *, reject: bool) -> bool:
        if self._settled:
            log.warning("delivery already settled", extra={"event": "settle_ignored"})
            return False
        self._settled = True
        return await self._transport._settle(self._claim, reject=reject)
