"""JSON logs and the W3C trace context: one ``traceparent`` from the HTTP request through the
outbox row and the message headers to the worker's log lines, on both backends; lifecycle
lines carry ``jobId``, ``event`` and ``attempt``; secrets never reach a line."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from jobrelay.api import create_app
from jobrelay.domain.states import JobState
from jobrelay.observe.logs import JsonFormatter
from jobrelay.storage.tables import outbox
from tests.integration.api_fixtures import bearer, build_runtime, make_token

from .ops_fixtures import (
    TRACE_ID,
    TRACEPARENT,
    new_job,
)
from .trace_fixtures import LogLines

pytestmark = pytest.mark.timeout(90)
LIFECYCLE = {"claimed", "retry_scheduled", "result_saved", "ack_sent"}


async def test_trace_reaches_the_worker_lines_through_a_retry(
    make_pipeline: Any, json_lines: LogLines
) -> None:
    async with make_pipeline(faults="export.run:transient:1") as p:
        job_id, _ = await p.store.submit(
            await new_job(p.store, headers={"traceparent": TRACEPARENT}), p.rt.clock()
        )
        p.start_relay()
        await p.start_worker()
        await p.wait_for(job_id, lambda j: j.state is JobState.SUCCEEDED)
        async with p.rt.engine.connect() as conn:
            headers = (
                await conn.execute(select(outbox.c.headers).where(outbox.c.job_id == job_id))
            ).scalars()
            assert [h.get("traceparent") for h in headers] == [TRACEPARENT, TRACEPARENT]

    entries = json_lines.entries()
    worker = [e for e in entries if e["logger"] == "jobrelay.worker" and e.get("jobId") == job_id]
    assert {e["event"] for e in worker} >= LIFECYCLE
    for entry in worker:
        assert entry["trace_id"] == TRACE_ID, entry
        if entry["event"] in LIFECYCLE:
            assert entry["attempt"] in (1, 2), entry
    claims = [e["attempt"] for e in worker if e["event"] == "claimed"]
    assert claims == [1, 2]
    published = [e for e in entries if e.get("event") == "published" and e.get("jobId") == job_id]
    assert len(published) == 2 and all(e["trace_id"] == TRACE_ID for e in published)


async def test_at_info_the_worker_logs_a_line_per_batch_of_settles_not_per_job(
    make_pipeline: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    async with make_pipeline(faults="export.run:invalid@period=2020-04") as p:
        jobs = [await p.submit(period=f"2020-0{n}") for n in range(1, 5)]
        p.start_relay()
        await p.start_worker()
        for job_id in jobs:
            await p.wait_for(job_id, lambda j: j.state.is_terminal)
        await p.stop_all()  # the worker's last batch is logged as it stops
        kinds = {job_id: await p.kinds(job_id) for job_id in jobs}
    worker = [r for r in caplog.records if r.name == "jobrelay.worker"]
    per_job = [r for r in worker if getattr(r, "event", None) in LIFECYCLE]
    assert not per_job, [r.getMessage() for r in per_job]  # DEBUG lines, not captured
    assert [getattr(r, "event", None) for r in worker].count("quarantined") == 1  # still INFO
    settled = [r for r in worker if getattr(r, "event", None) == "settled"]
    assert sum(r.acked for r in settled) == 3
    assert sum(r.rejected for r in settled) == 1
    assert sum(r.count for r in settled) == len(jobs)
    # The timeline still has every job's story.
    for job_id in jobs:
        assert "claimed" in kinds[job_id]
        assert ("ack_sent" in kinds[job_id]) != ("rejected" in kinds[job_id])


async def test_api_lines_carry_the_trace_and_never_the_token(
    sqlite_url: str, tmp_path: Path, json_lines: LogLines
) -> None:
    runtime = build_runtime(sqlite_url, tmp_path)
    token = await make_token(runtime, "acme")
    app = create_app(runtime.settings, runtime=runtime)
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://api.test"
        ) as client:
            accepted = await client.post(
                "/v1/exports",
                json={"accountId": "acme", "period": "2020-05"},
                headers={**bearer(token), "traceparent": TRACEPARENT},
            )
            assert accepted.status_code == 202
            assert (await client.get("/v1/whoami", headers=bearer(token + "x"))).status_code == 401
    finally:
        await runtime.engine.dispose()

    [line] = [e for e in json_lines.entries() if e.get("event") == "job_accepted"]
    assert line["trace_id"] == TRACE_ID and line["jobId"] == accepted.json()["jobId"]
    assert line["attempt"] == 0
    assert all(token not in raw and token[3:] not in raw for raw in json_lines.lines)
    assert all('"period"' not in raw for raw in json_lines.lines)  # no payload bodies


def test_formatter_masks_secrets_that_slip_into_a_message() -> None:
    formatter = JsonFormatter("test")
    record = logging.LogRecord(
        "jobrelay.test",
        logging.WARNING,
        __file__,
        1,
        "failed: %s",
        (
            "token jr_AbCdEfGhIjKlMnOpQrStUvWxYz0123456789 via "
            "amqp://app:s3cret@mq:5672/ with Authorization: Bearer abcdefghij.klmnop",
        ),
        None,
    )
    line = formatter.format(record)
    assert "s3cret" not in line and "AbCdEfGh" not in line and "abcdefghij" not in line
    assert "amqp://app:***@mq:5672/" in json.loads(line)["msg"]
