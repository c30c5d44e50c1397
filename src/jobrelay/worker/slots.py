"""A queue's job slots: how many of its deliveries a worker starts at once.

The broker window (``prefetch``) and the concurrency are two numbers (issue 23). The window
keeps the next deliveries at hand, so a batch of claims is ready the moment slots free up, and
lets their acks go as one frame. The slots bound what is started: a delivery is taken from
the transport only when a slot is reserved for it, so what waits for a slot is still the
transport's, unclaimed, and goes back uncounted when the consumer stops (a pause, a drain).
A job is therefore claimed only once it can run: a worker that dies never spends an attempt
of a job it had not started.

A reservation is made before the transport is asked for the next delivery and is carried by
the delivery until it starts (``started``): two consumers of one queue (a session's first and
the ones added as earlier work frees its slots) never both take the last slot.

A started delivery that waits for something else than the job's own work, a ``def`` job's
delivery waiting for a thread of the worker (``worker.threads``), is set aside meanwhile: its
slot is free for the next delivery, so ``async def`` jobs run on while every thread is held,
and it takes a slot back (waiting for one) once it has its thread, before its claim.

A job whose code has returned with a success to commit (no hooks of its type left to run)
lends its slot (``lend``): the next delivery starts now, and its claim is held by the loan's
``Gate`` (``batching``) until it goes in the same statement as the lender's completion or
the lender's outcome has committed (``work_done``, or its end). A worker's claims therefore
never hold more jobs ``running`` than its slots, while the next claim meets the completion
that frees its slot, one statement for both where it used to wait for that commit first. A
slot freed while it holds a loan not yet met (its delivery set aside, or ended) keeps the
gate for whoever takes it next. A lender whose completion failed (an outage) and that runs
again stays in its lent slot, taking no other: the borrower waits for its outcome. A lender
whose result could not be published (a completion's own step, ``storage.outcomes``) loses
its completion alone, the claim beside it committing with the rest: its code has ended, and
only its failure is left to write, so for that moment one more job than the slots is
``running`` and no more code runs than the slots allow.
"""

from __future__ import annotations

import asyncio
import contextvars

from jobrelay.batching import Gate

# The slots of the delivery a task handles (set by the consume loop; None when handled alone).
delivery_slots: contextvars.ContextVar[Slots | None] = contextvars.ContextVar(
    "delivery_slots", default=None
)


class Slots:
    def __init__(self, limit: int, busy: set[asyncio.Task[None]]) -> None:
        self.limit = limit
        self.busy = busy  # the queue's deliveries started and not yet finished
        self.reserved = 0  # taken from the transport, or being taken, and not yet started
        self.aside: set[asyncio.Task[None]] = set()  # started, holding no slot meanwhile
        self._freed = asyncio.Event()
        self.lent: dict[asyncio.Task[None], Gate] = {}  # a lender's loan, until it commits
        self._gates: list[Gate] = []  # loans of free slots, for the next reservations
        self._reserved_gates: list[Gate] = []  # loans taken by reservations not yet started
        self._borrowed: dict[asyncio.Task[None], Gate] = {}  # loans of started deliveries

    @property
    def free(self) -> int:
        return self.limit - len(self.busy) - self.reserved

    async def reserve(self) -> None:
        """Wait for a free slot and hold it for the next delivery (with the slot's loan, if
        it is one)."""
        while self.free <= 0:
            self._freed.clear()
            await self._freed.wait()
        self.reserved += 1
        while self._gates:
            if not (gate := self._gates.pop()).is_open:
                gate.taken, gate.asked = True, False
                self._reserved_gates.append(gate)
                break

    def unreserve(self) -> None:
        """The reservation was not used (the stream ended, the consumer stopped)."""
        self.reserved -= 1
        if self._reserved_gates:
            gate = self._reserved_gates.pop()
            gate.taken = False
            self._gates.append(gate)
        self._freed.set()

    def started(self, task: asyncio.Task[None]) -> None:
        """The reserved delivery started as ``task``: its slot is busy until it ends."""
        self._take_reserved(task)
        task.add_done_callback(self._ended)

    def lend(self, task: asyncio.Task[None], request: object) -> Gate | None:
        """``task``'s code returned and only ``request``, its completion, is left: its slot
        is free for the next delivery, whose claim goes beside ``request`` or after the
        outcome commits (``work_done``). Again (the completion sent again): the same loan,
        beside the new request. The loan's gate; None for a task that holds no slot."""
        gate = self.lent.get(task)
        if gate is None:
            if task not in self.busy:
                return None
            self.lent[task] = gate = Gate()
            self._gates.append(gate)
            self.set_aside(task)
        gate.request = request
        return gate

    def gate_of(self, task: asyncio.Task[None]) -> Gate | None:
        """The loan ``task``'s claim waits for, if its slot is one not met yet."""
        gate = self._borrowed.get(task)
        return None if gate is None or gate.is_open else gate

    def met(self, task: asyncio.Task[None]) -> None:
        """``task``'s claim was answered: it went beside its lender's completion or after
        it, so its slot is its own."""
        self._borrowed.pop(task, None)

    def set_aside(self, task: asyncio.Task[None]) -> None:
        """``task`` waits for something else (a thread): its slot is free meanwhile (with
        the loan it had not met)."""
        self.busy.discard(task)
        self.aside.add(task)
        self._give_back_loan(task)
        self._freed.set()

    def work_done(self, task: asyncio.Task[None]) -> None:
        """``task`` runs none of the application's code any more (its outcome has committed
        and its hooks have run): what is left starts no work, so its slot is free for the
        next delivery now (it stays aside, unsettled, until it ends), and what waits for
        its loan goes. Called twice, the second is nothing."""
        self._repaid(task)
        if task in self.busy:
            self.set_aside(task)

    async def take_back(self, task: asyncio.Task[None]) -> None:
        """Wait for a free slot for ``task`` set aside; it is busy again (cancelled while it
        waits, it stays aside until it ends)."""
        await self.reserve()
        self.aside.discard(task)
        self._take_reserved(task)

    def _take_reserved(self, task: asyncio.Task[None]) -> None:
        self.reserved -= 1
        self.busy.add(task)
        if self._reserved_gates:
            self._borrowed[task] = self._reserved_gates.pop()

    def _repaid(self, task: asyncio.Task[None]) -> None:
        """``task``'s loan, if it lent its slot, is over: what it held goes."""
        if (gate := self.lent.pop(task, None)) is not None:
            gate.open()
            if gate in self._gates:
                self._gates.remove(gate)

    def _give_back_loan(self, task: asyncio.Task[None]) -> None:
        if (gate := self._borrowed.pop(task, None)) is not None and not gate.is_open:
            gate.taken = False
            self._gates.append(gate)

    def _ended(self, task: asyncio.Task[None]) -> None:
        self.busy.discard(task)
        self.aside.discard(task)
        self._repaid(task)
        self._give_back_loan(task)
        self._freed.set()
