"""Natural batching: requests made while a batch is in flight go together in the next one.

Each delivery asks for its claim (or completion) as if alone and awaits its own answer. The
first request starts a batch at once (no timer, so an idle worker adds no latency); while that
batch's statement runs, the requests of the other deliveries queue up and leave together in
the next. Under load a batch is as large as the work in flight, at most ``max_size`` of each
``kind``. Each kind has its own lane: a batch of one kind in flight never holds up the next
request of another, and each batch takes what is pending of every kind (a worker's turn:
the claims and the completions waiting, one statement for both). Two
requests for the same key never share a batch: the later one waits for the next (a claim of
two copies of one job must be two guarded statements, one of which loses).

A request may be held by a ``Gate``: it goes only in the statement of the gate's
``request`` (while that is pending) or once the gate is opened. A worker's claim made in the
slot of a job whose completion is pending so never commits before that completion: beside
it, in one statement, or after it.

A batch is never failed for one request's fault: when its statement fails for a reason
``alone_on`` accepts (a data error, not an outage), each request is sent again alone, so
the one that cannot be stored fails by itself and its neighbours get their own answers. An
outage fails every waiter of the batch: each holds its delivery and retries.

With ``span`` named and a trace recorded, each request's span gets a child of that name whose
start and end are its batch statement's (``observe.tracing.batch_spans``). The batch runs in
a context of its own, not its first request's: nothing it logs or traces is one job's.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Awaitable, Callable, Hashable, Sequence
from typing import Generic, TypeVar

from opentelemetry.context import Context

from jobrelay.observe import tracing

log = logging.getLogger("jobrelay.tracing")

Req = TypeVar("Req")
Res = TypeVar("Res")


# The most loop turns a statement waits for a claim on its way into a lent slot: the
# delivery's path from the broker's buffer to its claim (the consumer's feed, its session,
# the delivery's task) is three or four.
LINGER_TURNS = 5


class Gate:
    """What a held request waits for: ``request`` (the one it may go beside) to be taken into
    a statement with it, or ``open()``."""

    def __init__(self) -> None:
        self.request: object | None = None
        self.is_open = False
        self.taken = False  # a delivery is starting in the lent slot (``worker.slots``)
        self.asked = False  # ... and has made its request
        self._wakers: list[Callable[[], None]] = []

    @property
    def coming(self) -> bool:
        """Whether a request held by this gate is on its way (not made yet)."""
        return self.taken and not self.asked and not self.is_open

    def open(self) -> None:
        """The held requests may go in any statement from now on (twice is nothing)."""
        if self.is_open:
            return
        self.is_open = True
        wakers, self._wakers = self._wakers, []
        for wake in wakers:
            wake()

    def wake_on_open(self, wake: Callable[[], None]) -> None:
        self._wakers.append(wake)


class Batcher(Generic[Req, Res]):
    def __init__(
        self,
        run: Callable[[Sequence[Req]], Awaitable[Sequence[Res]]],
        key: Callable[[Req], Hashable],
        *,
        max_size: int = 100,
        kind: Callable[[Req], Hashable] = lambda _: None,
        alone_on: Callable[[Exception], bool] = lambda _: False,
        span: str | Callable[[Req], str] | None = None,
    ) -> None:
        self._run = run
        self._span = span
        self._key = key
        self._kind = kind
        self._max = max_size
        self._alone_on = alone_on
        self._pending: list[tuple[Req, asyncio.Future[Res]]] = []
        # The trace context each pending request was made in (None: none recorded).
        self._contexts: dict[int, Context | None] = {}
        # The gate each held pending request waits for (by its future's id).
        self._gates: dict[int, Gate] = {}
        # The gate of each pending request that lent its slot (by the request's id).
        self._lenders: dict[int, Gate] = {}
        # One flush loop a kind at most (its lane): a claim never waits for a completion's
        # statement to start its own, and each statement takes what is pending of every kind.
        self._lanes: dict[Hashable, asyncio.Task[None]] = {}
        self.batches = 0  # for tests and metrics: how many statements were sent
        # The held requests sent (a claim in a lent slot): in their lender's statement, or
        # after its gate opened (the lender's commit) — how often the linger catches it.
        self.beside = 0
        self.after = 0

    async def submit(
        self, request: Req, *, after: Gate | None = None, lends: Gate | None = None
    ) -> Res:
        """``request``'s answer, from the statement it went in; held by ``after`` until
        that gate's request goes with it or the gate opens. ``lends``: the gate of the
        request's lent slot, whose held request the statement waits for a moment."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Res] = loop.create_future()
        self._pending.append((request, future))
        if self._span is not None:
            self._contexts[id(future)] = tracing.current()
        if after is not None:
            after.asked = True
            if after.is_open:
                self.after += 1
            else:
                self._gates[id(future)] = after
                after.wake_on_open(self._wake)
        if lends is not None:
            self._lenders[id(request)] = lends
        self._start_lane(self._kind(request))
        # A cancelled caller cancels only its own future, never the batch the others wait
        # on (that is the flush's task): its request was sent or will be, and the answer is
        # then not set (``done()``). No ``shield``: its outer future and callbacks per request
        # were a tenth of the embedded default's event-loop time.
        return await future

    def _start_lane(self, kind: Hashable) -> None:
        lane = self._lanes.get(kind)
        if lane is None or lane.done():
            loop = asyncio.get_running_loop()
            self._lanes[kind] = loop.create_task(self._flush(kind), context=contextvars.Context())

    def _wake(self) -> None:
        """A gate opened: the lanes of what it held start again where they had ended."""
        for kind in {self._kind(request) for request, _ in self._pending}:
            if self._sendable(kind):
                self._start_lane(kind)

    def _held(self, future: asyncio.Future[Res]) -> Gate | None:
        gate = self._gates.get(id(future))
        return None if gate is None or gate.is_open else gate

    def _sendable(self, kind: Hashable) -> bool:
        """Whether a request of ``kind`` could go now: not held, or held beside a request
        that is pending too."""
        pending: set[int] | None = None  # built only once a held request is met
        for request, future in self._pending:
            if self._kind(request) == kind:
                gate = self._held(future)
                if gate is None:
                    return True
                if pending is None:
                    pending = {id(each) for each, _ in self._pending}
                if id(gate.request) in pending:
                    return True
        return False

    async def _flush(self, kind: Hashable) -> None:
        await asyncio.sleep(0)  # the deliveries of this loop iteration join the first batch
        while self._sendable(kind):
            await self._linger()
            batch = self._compose()
            self.batches += 1
            started = tracing.now_ns()
            try:
                results = await self._run([request for request, _ in batch])
            except asyncio.CancelledError:  # the worker is being torn down: nobody answers
                for _, future in batch + self._pending:
                    future.cancel()
                self._pending = []
                self._contexts.clear()
                self._gates.clear()
                self._lenders.clear()
                raise
            except Exception as exc:
                if len(batch) > 1 and self._alone_on(exc):
                    await self._one_by_one(batch)
                    continue
                for _, future in batch:  # an outage: every waiter of this batch gets it
                    self._contexts.pop(id(future), None)
                    self._gates.pop(id(future), None)
                    if not future.done():
                        future.set_exception(exc)
                continue
            self._trace(batch, started)
            for (_, future), result in zip(batch, results, strict=True):
                self._gates.pop(id(future), None)
                if not future.done():
                    future.set_result(result)

    async def _linger(self) -> None:
        """A statement about to carry a completion whose slot is lent waits up to
        ``LINGER_TURNS`` loop turns while the claim that slot is starting is on its way
        (the delivery is taken and handed to its task): a claim that misses the statement
        waits for its commit instead. Nothing on its way, no wait."""
        for _ in range(LINGER_TURNS):
            if not any(gate.coming for gate in self._lenders.values()):
                return
            await asyncio.sleep(0)

    def _compose(self) -> list[tuple[Req, asyncio.Future[Res]]]:
        """The next statement's requests, taken from the pending: at most ``max_size`` of
        each kind, a key once, the held ones only beside their gate's request."""
        batch: list[tuple[Req, asyncio.Future[Res]]] = []
        rest: list[tuple[Req, asyncio.Future[Res]]] = []
        held: list[tuple[Req, asyncio.Future[Res]]] = []
        seen: set[Hashable] = set()
        sizes: dict[Hashable, int] = {}

        def fits(request: Req) -> bool:
            key, kind = self._key(request), self._kind(request)
            if sizes.get(kind, 0) >= self._max or key in seen:
                return False
            seen.add(key)
            sizes[kind] = sizes.get(kind, 0) + 1
            return True

        for item in self._pending:
            if self._held(item[1]) is not None:
                held.append(item)
            else:
                (batch if fits(item[0]) else rest).append(item)
        chosen = {id(request) for request, _ in batch}
        for item in held:
            gate = self._held(item[1])
            assert gate is not None
            if id(gate.request) in chosen and fits(item[0]):
                batch.append(item)
                self.beside += 1
            else:
                rest.append(item)
        self._pending = rest
        for request, future in batch:
            self._lenders.pop(id(request), None)
            if (gate := self._gates.get(id(future))) is not None and gate.is_open:
                self.after += 1  # it waited for the gate
        return batch

    def _trace(self, batch: list[tuple[Req, asyncio.Future[Res]]], started: int) -> None:
        """Each request's span of its batch statement; the contexts of a batch that failed
        are dropped with it."""
        span = self._span
        if span is None:
            return
        named: dict[str, list[tuple[Context | None, Hashable]]] = {}
        for request, future in batch:
            name = span if isinstance(span, str) else span(request)
            context = self._contexts.pop(id(future), None)
            named.setdefault(name, []).append((context, self._key(request)))
        ended = tracing.now_ns()
        for name, contexts in named.items():
            if all(c is None for c, _ in contexts):
                continue
            try:
                tracing.batch_spans(name, contexts, started, ended)
            except Exception:  # a span processor's fault: the batch's answers still go out
                log.warning("batch spans not recorded", exc_info=True)

    async def _one_by_one(self, batch: list[tuple[Req, asyncio.Future[Res]]]) -> None:
        """Each request of a failed batch in a statement of its own: its own answer or error.
        A held request whose gate's request failed alone waits again (it came after it)."""
        failed: set[int] = set()
        for request, future in batch:
            gate = self._held(future)
            if gate is not None and id(gate.request) in failed:
                self._pending.append((request, future))
                continue
            self._gates.pop(id(future), None)
            self.batches += 1
            started = tracing.now_ns()
            try:
                [result] = await self._run([request])
            except asyncio.CancelledError:
                for _, waiting in batch + self._pending:
                    waiting.cancel()
                self._pending = []
                self._contexts.clear()
                self._gates.clear()
                self._lenders.clear()
                raise
            except Exception as exc:
                failed.add(id(request))
                self._contexts.pop(id(future), None)
                if not future.done():
                    future.set_exception(exc)
                continue
            self._trace([(request, future)], started)
            if not future.done():
                future.set_result(result)
