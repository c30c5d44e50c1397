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
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable, Sequence
from typing import Generic, TypeVar

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
    ) -> None:
        self._run = run
        self._key = key
        self._max = max_size
        self._alone_on = alone_on
        self._pending: list[tuple[Req, asyncio.Future[Res]]] = []
        self._flushing: asyncio.Task[None] | None = None
        self.batches = 0  # for tests and metrics: how many statements were sent

    async def submit(self, request: Req) -> Res:
        future: asyncio.Future[Res] = asyncio.get_running_loop().create_future()
        self._pending.append((request, future))
        if self._flushing is None or self._flushing.done():
            self._flushing = asyncio.create_task(self._flush())
        # Shielded: a cancelled caller must not cancel the batch the others wait on; its
        # request was sent or will be, and the answer is then simply not read.
        return await asyncio.shield(future)

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
            try:
                results = await self._run([request for request, _ in batch])
            except asyncio.CancelledError:  # the worker is being torn down: nobody answers
                for _, future in batch + self._pending:
                    future.cancel()
                self._pending = []
                raise
            except Exception as exc:
                if len(batch) > 1 and self._alone_on(exc):
                    await self._one_by_one(batch)
                    continue
                for _, future in batch:  # an outage: every waiter of this batch gets it
                    if not future.done():
                        future.set_exception(exc)
                continue
            for (_, future), result in zip(batch, results, strict=True):
                if not future.done():
                    future.set_result(result)

    async def _one_by_one(self, batch: list[tuple[Req, asyncio.Future[Res]]]) -> None:
        """Each request of a failed batch in a statement of its own: its own answer or error."""
        for request, future in batch:
            self.batches += 1
            try:
                [result] = await self._run([request])
            except asyncio.CancelledError:
                for _, waiting in batch + self._pending:
                    waiting.cancel()
                self._pending = []
                raise
            except Exception as exc:
                if not future.done():
                    future.set_exception(exc)
                continue
            if not future.done():
                future.set_result(result)
