"""The soak's HTTP clients: submit every planned export and write down what each request saw.

Each HTTP request ends as one of three outcomes, as a careful client would see it:

- ``ok``: 202/200 with a jobId: the job was accepted, so it must never be lost;
- ``failed``: a 4xx: the request was refused and must have changed nothing;
- ``unknown``: a 5xx, a dropped connection or a timeout: the client cannot tell whether the
  job was created. The checker resolves these afterwards from the database.

Like any well-behaved client, an ``unknown`` is retried with the same ``Idempotency-Key``
(so a retry can never create a second job), with a capped back-off, until it becomes ``ok``
or ``failed`` or the clients' patience runs out (``Pacer.overdue``).

The submissions are paced by the fault plan, not by the clock alone (``Pacer``): a fault that
needs work to reach its point gets its share of the load when it begins, however late it
begins on a slow machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import httpx

from jobrelay.chaos.plan import Submission

Outcome = Literal["ok", "failed", "unknown"]


@dataclass(frozen=True)
class Request:
    at: float  # seconds since the clients started
    outcome: Outcome
    status: int | None
    detail: str
    # Wall-clock bounds of the request, to tell afterwards whether an unknown one committed.
    started: float = 0.0
    ended: float = 0.0


@dataclass
class Record:
    submission: Submission
    requests: list[Request] = field(default_factory=list)
    job_id: str | None = None  # as the API answered it

    @property
    def outcome(self) -> Outcome:
        """The last word: ok if any request was accepted, else the last request's outcome."""
        if any(r.outcome == "ok" for r in self.requests):
            return "ok"
        return self.requests[-1].outcome if self.requests else "unknown"


class Pacer:
    """When each submission is due. The submissions are spread over the plan's steps (a
    fault: its pause and its estimated time) in proportion to the steps' estimates, and a
    step's share is released only once the soak has begun that step, at its own spacing from
    that moment. When the faults run as estimated this is an even spread over the plan; on a
    machine slower than the estimates the load stretches with the faults instead of running
    out before the last of them (CI: a failover to be held at a completion came 20 s after
    the last submission, and no job reached the point)."""

    def __init__(self, steps: Sequence[float], count: int) -> None:
        self.steps = list(steps) or [0.0]
        self.count = max(count, 1)
        self.begun: list[float | None] = [None] * len(self.steps)
        self._begun = asyncio.Condition()

    async def begin(self, step: int) -> None:
        """The soak has begun ``step`` (a step it has already begun, or one beyond the
        pacer's, changes nothing). Earlier steps not marked begun are begun with it."""
        if step >= len(self.steps) or self.begun[step] is not None:
            return
        now = time.monotonic()
        for earlier in range(step + 1):
            if self.begun[earlier] is None:
                self.begun[earlier] = now
        async with self._begun:
            self._begun.notify_all()

    def place(self, index: int) -> tuple[int, float]:
        """The step submission ``index`` belongs to and its offset into that step."""
        at = index * sum(self.steps) / self.count
        for step, length in enumerate(self.steps[:-1]):
            if at < length:
                return step, at
            at -= length
        return len(self.steps) - 1, at

    def due_at(self, index: int) -> float | None:
        """When submission ``index`` is due (``time.monotonic``), None until its step has
        begun."""
        step, offset = self.place(index)
        begun = self.begun[step]
        return None if begun is None else begun + offset

    async def wait(self, index: int) -> None:
        """Until submission ``index`` is due."""
        async with self._begun:
            await self._begun.wait_for(lambda: self.due_at(index) is not None)
        due = (self.due_at(index) or 0.0) - time.monotonic()
        if due > 0:
            await asyncio.sleep(due)  # pacing the load, not synchronising

    def overdue(self, patience: float) -> bool:
        """Whether ``patience`` seconds have passed since the last step's estimated end: no
        retry of a client starts after that."""
        last = self.begun[-1]
        return last is not None and time.monotonic() > last + self.steps[-1] + patience


class Clients:
    def __init__(
        self,
        base_urls: list[str],
        tokens: dict[str, str],
        *,
        concurrency: int,
        pace: Pacer,
        patience: float,
    ) -> None:
        self.base_urls = base_urls  # every API process; client loops are spread over them
        self.tokens = tokens
        self.concurrency = concurrency
        self.pace = pace
        self.patience = patience  # seconds past the plan's estimated end a retry may start
        self.records: list[Record] = []
        self.started = 0.0

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    async def run(self, submissions: tuple[Submission, ...]) -> list[Record]:
        self.started = time.monotonic()
        self.records = [Record(s) for s in submissions]
        queue: asyncio.Queue[Record] = asyncio.Queue()
        for record in self.records:
            queue.put_nowait(record)
        await self.pace.begin(0)
        limits = httpx.Limits(max_connections=self.concurrency)
        async with contextlib.AsyncExitStack() as stack:
            clients = [
                await stack.enter_async_context(
                    httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(10.0), limits=limits)
                )
                for base in self.base_urls
            ]

            async def loop(client: httpx.AsyncClient) -> None:
                while not queue.empty():
                    record = queue.get_nowait()
                    await self.pace.wait(record.submission.index)
                    await self._submit(client, record)

            await asyncio.gather(
                *(loop(clients[i % len(clients)]) for i in range(self.concurrency))
            )
        return self.records

    async def _submit(self, client: httpx.AsyncClient, record: Record) -> None:
        s = record.submission
        body = {"accountId": s.account, "period": s.period, "notifyEmail": s.email}
        headers = {"Authorization": f"Bearer {self.tokens[s.account]}", "Idempotency-Key": s.key}
        backoff = 0.2
        while True:
            request = await self._once(client, body, headers)
            record.requests.append(request)
            if request.outcome == "ok":
                record.job_id = request.detail
                return
            if request.outcome == "failed" or self.pace.overdue(self.patience):
                return
            await asyncio.sleep(backoff)  # a client's retry back-off
            backoff = min(backoff * 2, 2.0)

    async def _once(
        self, client: httpx.AsyncClient, body: dict[str, str], headers: dict[str, str]
    ) -> Request:
        started = time.time()
        request = await self._post(client, body, headers)
        return dataclasses.replace(request, started=started, ended=time.time())

    async def _post(
        self, client: httpx.AsyncClient, body: dict[str, str], headers: dict[str, str]
    ) -> Request:
        at = self.elapsed()
        try:
            response = await client.post("/v1/exports", json=body, headers=headers)
        except httpx.HTTPError as exc:
            return Request(at, "unknown", None, f"{type(exc).__name__}: {exc}"[:200])
        if response.status_code in (200, 202):
            try:
                job_id = str(response.json()["jobId"])
            except (ValueError, KeyError):
                return Request(at, "unknown", response.status_code, "no jobId in the answer")
            return Request(at, "ok", response.status_code, job_id)
        outcome: Outcome = "failed" if 400 <= response.status_code < 500 else "unknown"
        return Request(at, outcome, response.status_code, response.text[:200])
