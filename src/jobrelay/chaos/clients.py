"""The soak's HTTP clients: submit every planned export and write down what each request saw.

Each HTTP request ends as one of three outcomes, as a careful client would see it:

- ``ok``: 202/200 with a jobId: the job was accepted, so it must never be lost;
- ``failed``: a 4xx: the request was refused and must have changed nothing;
- ``unknown``: a 5xx, a dropped connection or a timeout: the client cannot tell whether the
  job was created. The checker resolves these afterwards from the database.

Like any well-behaved client, an ``unknown`` is retried with the same ``Idempotency-Key``
(so a retry can never create a second job), with a capped back-off, until it becomes ``ok``
or ``failed`` or the clients' deadline passes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
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


class Clients:
    def __init__(
        self,
        base_urls: list[str],
        tokens: dict[str, str],
        *,
        concurrency: int,
        window: float,
        deadline: float,
    ) -> None:
        self.base_urls = base_urls  # every API process; client loops are spread over them
        self.tokens = tokens
        self.concurrency = concurrency
        self.window = window  # submissions are spread evenly over this many seconds
        self.deadline = deadline  # no request starts later than this (seconds from start)
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
        spacing = self.window / max(len(submissions), 1)
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
                    due = record.submission.index * spacing - self.elapsed()
                    if due > 0:
                        await asyncio.sleep(due)  # pacing the load, not synchronising
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
            if request.outcome == "failed" or self.elapsed() > self.deadline:
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
