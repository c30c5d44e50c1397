"""Pausing a work queue stops a running worker taking its deliveries; resuming drains them.

On SQLite + the local transport and on PostgreSQL + RabbitMQ (``backend``): the messages of
jobs submitted while the queue is paused are published and wait in the broker, no job is
claimed; after the resume every one of them succeeds, each on its first attempt.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest

from jobrelay.domain.states import JobState
from jobrelay.errors import StoreError
from jobrelay.runtime.wiring import build_transport
from jobrelay.storage.queue_pauses import paused_queues, queue_history, set_paused
from jobrelay.transport.base import ReportsQueues
from jobrelay.worker.consumer import Worker
from jobrelay.worker.queue_gate import QueueGate

from .ops_fixtures import eventually

pytestmark = pytest.mark.timeout(120)


async def default_queue(transport: Any) -> Any:
    assert isinstance(transport, ReportsQueues)
    return next(s for s in await transport.queue_stats() if s.queue == "default")


async def test_pause_holds_deliveries_in_the_broker_and_resume_drains_them(
    make_pipeline: Any,
) -> None:
    async with make_pipeline(queue_pause_poll_seconds="0.1") as p:
        rt = p.rt
        p.start_relay()
        transport = build_transport(rt.settings, rt.engine, rt.clock)
        await transport.connect()
        p.worker_transports.append(transport)
        worker = Worker(dataclasses.replace(rt, transport=transport))
        stop = asyncio.Event()
        p.stops.append(stop)
        p.workers.append(asyncio.create_task(worker.run(stop)))

        first = await p.submit(period="2020-01")  # the worker consumes before the pause
        await p.wait_for(first, lambda j: j.state is JobState.SUCCEEDED)

        now = rt.clock()
        assert await set_paused(rt.store, "default", True, actor="t", reason="deploy", now=now)
        assert not await set_paused(rt.store, "default", True, actor="t", reason="x", now=now)
        await eventually(
            lambda: asyncio.sleep(0, worker.gate.is_paused("default")), what="the pause"
        )
        if rt.settings.broker_url != "local":  # basic.cancel: the broker sees no consumer
            await eventually(
                lambda: _zero_consumers(rt.transport), what="the consumer to be cancelled"
            )
        held = [await p.submit(period=f"2020-0{i}") for i in range(2, 6)]
        await eventually(lambda: _ready(rt.transport, len(held)), what="the messages in the broker")
        for job_id in held:
            # The broker can hold a message before its confirm reaches the relay, which marks
            # the row published only then: wait for the mark, not only for the broker.
            job = await p.wait_for(job_id, lambda j: j.published)
            assert job.state is JobState.QUEUED and job.attempt == 0
            assert "claimed" not in await p.kinds(job_id)

        assert await set_paused(
            rt.store, "default", False, actor="t", reason="deployed", now=rt.clock()
        )
        for job_id in held:
            job = await p.wait_for(job_id, lambda j: j.state is JobState.SUCCEEDED)
            assert job.attempt == 1
            assert (await p.kinds(job_id)).count("result_saved") == 1
        assert (await default_queue(rt.transport)).ready == 0
        history = await queue_history(rt.store, "default")
        assert [(e.kind, e.reason) for e in history] == [
            ("resumed", "deployed"),
            ("paused", "deploy"),
        ]


async def _zero_consumers(transport: Any) -> bool:
    return bool((await default_queue(transport)).consumers == 0)


async def _ready(transport: Any, n: int) -> bool:
    return bool((await default_queue(transport)).ready == n)


async def test_a_worker_whose_first_pause_read_fails_does_not_consume_a_paused_queue(
    make_pipeline: Any,
) -> None:
    # Issue 21, item 10: a failed first read used to leave every queue "running", so a
    # worker starting during a database blip consumed a queue an operator had paused.
    async with make_pipeline(queue_pause_poll_seconds="0.2") as p:
        rt = p.rt
        assert await set_paused(rt.store, "default", True, actor="t", reason="r", now=rt.clock())
        p.start_relay()
        job_id = await p.submit(period="2020-02")
        await p.wait_for(job_id, lambda j: j.published)
        transport = build_transport(rt.settings, rt.engine, rt.clock)
        await transport.connect()
        p.worker_transports.append(transport)
        opened: list[str] = []
        consume = transport.consume

        def spy(prefetch: int, queue: str = "default", **options: Any) -> Any:
            opened.append(queue)
            return consume(prefetch, queue, **options)

        transport.consume = spy  # type: ignore[method-assign]
        reads = 0
        second_read, answer = asyncio.Event(), asyncio.Event()

        async def read() -> set[str]:
            nonlocal reads
            reads += 1
            if reads == 1:
                raise StoreError("database away for the first read")
            if reads == 2:
                second_read.set()
                await answer.wait()
            return await paused_queues(rt.store)

        worker = Worker(dataclasses.replace(rt, transport=transport))
        worker.gate = QueueGate(read, worker.queues, 0.2)
        stop = asyncio.Event()
        p.stops.append(stop)
        p.workers.append(asyncio.create_task(worker.run(stop)))
        await asyncio.wait_for(second_read.wait(), 20)
        assert opened == [] and not worker.gate.is_known("default")  # unknown: not consumed
        answer.set()
        await eventually(lambda: asyncio.sleep(0, worker.gate.is_paused("default")), what="pause")
        assert opened == []
        job = await rt.store.get_job(job_id)
        assert job.state is JobState.QUEUED and job.attempt == 0
        assert await set_paused(rt.store, "default", False, actor="t", reason="r", now=rt.clock())
        job = await p.wait_for(job_id, lambda j: j.state is JobState.SUCCEEDED)
        assert job.attempt == 1 and opened == ["default"]
