"""A job whose type the worker does not know (a missing ``--app``, a rolling deploy) says so
(issue 34, item 15).

The worker defers such a message through the delay route, a fixed number of times, then
quarantines the job. Meanwhile ``job show`` asked "is a worker running?" of a job a worker
had just seen and passed on. Now the deferral names the worker, the type and the count, in
the event, in ``job show``'s next step and in the quarantine reason. Run on SQLite + the
local transport and on PostgreSQL + RabbitMQ (where the deferred copy goes through a
broker delay queue and comes back as a new delivery).
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
from typing import Any

import pytest

from jobrelay.admin.explain import explain_document
from jobrelay.domain.ids import request_hash
from jobrelay.domain.states import JobState
from jobrelay.runtime.wiring import build_transport
from jobrelay.storage.store import NewJob
from jobrelay.worker.consumer import Worker
from tests.id_keys import request_id

from .ops_fixtures import eventually

pytestmark = pytest.mark.timeout(120)

UNKNOWN = "images.resize"  # not a type of the exports app the pipeline's worker runs
LIMIT = 2


async def submit_unknown(rt: Any) -> str:
    params = {"imageId": 1}
    job = NewJob(
        job_id=await request_id(rt.store, "acme", params, job_type=UNKNOWN),
        type=UNKNOWN,
        account_id="acme",
        params=params,
        request_hash=request_hash("acme", UNKNOWN, params),
        max_attempts=rt.settings.max_attempts,
    )
    job_id, _ = await rt.store.submit(job, rt.clock())
    return str(job_id)


async def start_worker(p: Any, worker_id: str) -> None:
    rt = p.rt
    transport = build_transport(rt.settings, rt.engine, rt.clock, rt.app)
    await transport.connect()
    p.worker_transports.append(transport)
    worker = Worker(dataclasses.replace(rt, transport=transport), worker_id=worker_id)
    stop = asyncio.Event()
    p.stops.append(stop)
    p.workers.append(asyncio.create_task(worker.run(stop)))


async def test_an_unknown_type_names_the_worker_and_the_deferral(make_pipeline: Any) -> None:
    async with make_pipeline(delivery_limit=str(LIMIT), reconcile_seconds="0") as p:
        rt = p.rt
        job_id = await submit_unknown(rt)
        p.start_relay()
        await start_worker(p, "w1")

        async def deferred_once() -> Any:
            events = await rt.store.events(job_id)
            job = await rt.store.get_job(job_id)
            if job.state is JobState.QUEUED and any(e.kind == "deferred" for e in events):
                return job, events
            return None

        job, events = await eventually(deferred_once, timeout=60, what="a first deferral")
        deferrals = [e for e in events if e.kind == "deferred"]
        n = len(deferrals)
        said = f"worker w1 does not know type {UNKNOWN} (deferral {n} of {LIMIT})"
        assert deferrals[-1].detail["reason"] == said, deferrals[-1].detail
        assert deferrals[-1].detail["worker"] == "w1"
        assert deferrals[-1].detail["unknownType"] == UNKNOWN
        step = explain_document(job, events, rt.clock())["nextStep"]
        assert step.startswith(said), step
        assert "--app" in step and "is a worker running" not in step, step

        quarantined = await p.wait_for(
            job_id, lambda j: j.state is JobState.QUARANTINED, timeout=60
        )
        reason = quarantined.quarantine_reason
        assert reason is not None
        assert re.fullmatch(
            rf"worker w1 does not know type {re.escape(UNKNOWN)}, and no worker knew it after "
            rf"{LIMIT} deferrals: .*--app.*",
            reason,
        ), reason
        events = await rt.store.events(job_id)
        assert [e.detail["reason"] for e in events if e.kind == "deferred"] == [
            f"worker w1 does not know type {UNKNOWN} (deferral {i} of {LIMIT})"
            for i in range(1, LIMIT + 1)
        ]
        step = explain_document(quarantined, events, rt.clock())["nextStep"]
        assert step.startswith(f"quarantined: {reason}"), step
