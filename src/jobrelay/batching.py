"""Natural batching: requests made while a batch is in flight go together in the next one.

Each delivery asks for its claim (or completion) as if alone and awaits its own answer. The
first request starts a batch at once (no timer, so an idle worker adds no latency); while that
batch's statement runs, the requests of the other deliveries queue up and leave together in
the next. Under load a batch is as large as the work in flight, at most ``max_size``. Two
requests for the same key never share a batch: the later one waits for the next (a claim of
two copies of one job must be two guarded statements, one of which loses).

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


class Batcher(Generic[Req, Res]):
    def __init__(
        self,
        run: Callable[[Sequence[Req]], Awaitable[Sequence[Res]]],
        key: Callable[[Req], Hashable],
        *,
        max_size: int = 100,
        alone_on: Callable[[Exception], bool] = lambda _: False,
        span: str | None = None,
    ) -> None:
        self._run = run
        self._span = span
        self._key = key
        self._max = max_size
        self._alone_on = alone_on
        self._pending: list[tuple[Req, asyncio.Future[Res]]] = []
        # The trace context each pending request was made in (None: none recorded).
        self._contexts: dict[int, Context | None] = {}
        self._flushing: asyncio.Task[None] | None = None
        self.batches = 0  # for tests and metrics: how many statements were sent

    async def submit(self, request: Req) -> Res:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Res] = loop.create_future()
        self._pending.append((request, future))
        if self._span is not None:
            self._contexts[id(future)] = tracing.current()
        if self._flushing is None or self._flushing.done():
            self._flushing = loop.create_task(self._flush(), context=contextvars.Context())
        # A cancelled caller cancels only its own future, never the batch the others wait
        # on (that is the flush's task): its request was sent or will be, and the answer is
        # then not set (``done()``). No ``shield``: its outer future and callbacks per request
        # were a tenth of the embedded default's event-loop time.
        return await future

    async def _flush(self) -> None:
        await asyncio.sleep(0)  # the deliveries of this loop iteration join the first batch
        while self._pending:
            batch: list[tuple[Req, asyncio.Future[Res]]] = []
            seen: set[Hashable] = set()
            rest: list[tuple[Req, asyncio.Future[Res]]] = []
            for item in self._pending:
                key = self._key(item[0])
                if len(batch) < self._max and key not in seen:
                    seen.add(key)
                    batch.append(item)
                else:
                    rest.append(item)
            self._pending = rest
            self.batches += 1
            started = tracing.now_ns()
            try:
                results = await self._run([request for request, _ in batch])
            except asyncio.CancelledError:  # the worker is being torn down: nobody answers
                for _, future in batch + self._pending:
                    future.cancel()
                self._pending = []
                self._contexts.clear()
                raise
            except Exception as exc:
                if len(batch) > 1 and self._alone_on(exc):
                    await self._one_by_one(batch)
                    continue
                for _, future in batch:  # an outage: every waiter of this batch gets it
                    self._contexts.pop(id(future), None)
                    if not future.done():
                        future.set_exception(exc)
                continue
            self._trace(batch, started)
            for (_, future), result in zip(batch, results, strict=True):
                if not future.done():
                    future.set_result(result)

    def _trace(self, batch: list[tuple[Req, asyncio.Future[Res]]], started: int) -> None:
        """Each request's span of its batch statement; the contexts of a batch that failed
        are dropped with it."""
        if self._span is None:
            return
        contexts = [(self._contexts.pop(id(future), None), self._key(r)) for r, future in batch]
        if any(c is not None for c, _ in contexts):
            try:
                tracing.batch_spans(self._span, contexts, started, tracing.now_ns())
            except Exception:  # a span processor's fault: the batch's answers still go out
                log.warning("batch spans not recorded", exc_info=True)

    async def _one_by_one(self, batch: list[tuple[Req, asyncio.Future[Res]]]) -> None:
        """Each request of a failed batch in a statement of its own: its own answer or error."""
        for request, future in batch:
            self.batches += 1
            started = tracing.now_ns()
            try:
                [result] = await self._run([request])
            except asyncio.CancelledError:
                for _, waiting in batch + self._pending:
                    waiting.cancel()
                self._pending = []
                self._contexts.clear()
                raise
            except Exception as exc:
                self._contexts.pop(id(future), None)
                if not future.done():
                    future.set_exception(exc)
                continue
            self._trace([(request, future)], started)
            if not future.done():
                future.set_result(result)
