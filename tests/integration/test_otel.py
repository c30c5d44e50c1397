"""OpenTelemetry in one process, with the SDK's in-memory exporter (issue 39): the spans of
one export accepted over HTTP (request, enqueue, publish, run with its claim, commit and
ack), the timeline as span events, a retry's two runs linked to one enqueue, a job enqueued
in an application's own span, log lines that share the span's ids, and no secret anywhere."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import httpx
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from pydantic import BaseModel

import jobrelay
from jobrelay.api import create_app
from jobrelay.domain.states import JobState
from jobrelay.observe import tracing
from jobrelay.storage.admin import AdminQueries
from tests.integration.api_fixtures import bearer, make_token

from .ops_fixtures import TRACE_ID, TRACEPARENT
from .trace_fixtures import LogLines

pytestmark = pytest.mark.timeout(90)


def _hex(span: ReadableSpan) -> tuple[str, str]:
    ctx = span.get_span_context()
    assert ctx is not None
    return f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}"


def _parent(span: ReadableSpan) -> str | None:
    return f"{span.parent.span_id:016x}" if span.parent is not None else None


def _named(found: list[ReadableSpan], name: str) -> list[ReadableSpan]:
    return [s for s in found if s.name == name]


async def _export_over_http(p: Any, period: str) -> str:
    token = await make_token(p.rt, "acme")
    api = create_app(p.rt.settings, runtime=p.rt)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=api), base_url="http://api"
    ) as client:
        accepted = await client.post(
            "/v1/exports",
            json={"accountId": "acme", "period": period},
            headers={**bearer(token), "traceparent": TRACEPARENT},
        )
    assert accepted.status_code == 202, accepted.text
    return str(accepted.json()["jobId"])


async def test_one_export_is_one_trace_from_the_request_to_the_ack(
    make_pipeline: Any, spans: InMemorySpanExporter, json_lines: LogLines
) -> None:
    async with make_pipeline(faults="export.run:transient:1") as p:
        job_id = await _export_over_http(p, "2020-05")
        p.start_relay()
        await p.start_worker()
        await p.wait_for(job_id, lambda j: j.state is JobState.SUCCEEDED)
        await p.stop_all()
        job = await p.store.get_job(job_id)
        stored = await p.store.events(job_id)
    found = list(spans.get_finished_spans())

    # The request: a server span of ours, a child of the caller's traceparent.
    [request] = [s for s in found if s.kind is SpanKind.SERVER]
    assert request.name == "POST /v1/exports"
    assert _hex(request)[0] == TRACE_ID and _parent(request) == TRACEPARENT.split("-")[2]
    assert request.attributes is not None
    assert request.attributes["http.response.status_code"] == 202

    # The enqueue: a producer child of the request, with the job id.
    [enqueue] = _named(found, "enqueue")
    assert enqueue.kind is SpanKind.PRODUCER and _parent(enqueue) == _hex(request)[1]
    assert enqueue.attributes is not None
    assert enqueue.attributes["messaging.message.id"] == job_id
    assert enqueue.attributes["messaging.operation.type"] == "create"
    assert [e.name for e in enqueue.events] == ["accepted"]

    # Two publishes (the first message and the retry's), each a child of the enqueue.
    publishes = _named(found, "publish")
    assert len(publishes) == 2
    for publish in publishes:
        assert _hex(publish)[0] == TRACE_ID and _parent(publish) == _hex(enqueue)[1]
        assert publish.attributes is not None
        assert publish.attributes["messaging.message.id"] == job_id
        assert "published" in [e.name for e in publish.events]

    # Two runs (the retry is a new run), each its own trace, linked to the one enqueue.
    runs = sorted(_named(found, "run report.export"), key=lambda s: s.start_time or 0)
    assert len(runs) == 2
    for attempt, run in enumerate(runs, start=1):
        assert run.kind is SpanKind.CONSUMER
        assert run.parent is None
        assert [
            (f"{li.context.trace_id:032x}", f"{li.context.span_id:016x}") for li in run.links
        ] == [_hex(enqueue)]
        assert run.attributes is not None
        assert run.attributes["messaging.message.id"] == job_id
        assert run.attributes["jobrelay.attempt"] == attempt
        assert "jobrelay.account.hash" in run.attributes
        assert "acme" not in json.dumps(dict(run.attributes))
        children = [s for s in found if _parent(s) == _hex(run)[1]]
        names = sorted(s.name for s in children)
        assert names == ["ack", "claim", "commit"] if attempt == 2 else ["ack", "claim"], names
        for child in children:
            assert child.attributes is not None
            assert child.attributes["messaging.message.id"] == job_id, child.name
    first, second = runs
    assert [e.name for e in first.events] == ["claimed", "retry_scheduled", "exception", "ack_sent"]
    # The failed attempt: the account's reason as the status, the operators' text as the
    # exception event (as their logs carry it).
    assert not first.status.is_ok and first.status.description
    assert job is not None and first.status.description == job.public_error
    [exception] = [e for e in first.events if e.name == "exception"]
    assert exception.attributes is not None and "injected" in str(exception.attributes)
    assert (
        first.attributes is not None and first.attributes["jobrelay.outcome"] == "retry_scheduled"
    )
    assert [e.name for e in second.events] == ["claimed", "result_saved", "ack_sent"]
    assert second.attributes is not None and second.attributes["jobrelay.outcome"] == "result_saved"

    # The timeline's events are the spans' events, at the same times.
    by_kind = {e.kind: e.at for e in stored}
    [retry] = [e for e in first.events if e.name == "retry_scheduled"]
    assert retry.timestamp == int(by_kind["retry_scheduled"].timestamp() * 1e9)

    # The worker's log lines of each run carry that run's trace and span ids.
    entries = [json.loads(line) for line in json_lines.lines]
    claimed = [e for e in entries if e.get("event") == "claimed" and e.get("jobId") == job_id]
    assert [(e["trace_id"], e["span_id"]) for e in claimed] == [_hex(r) for r in runs]
    [accepted_line] = [e for e in entries if e.get("event") == "job_accepted"]
    assert (accepted_line["trace_id"], accepted_line["span_id"]) == _hex(request)


async def test_a_job_enqueued_in_the_applications_own_span_is_in_its_trace(
    make_pipeline: Any, spans: InMemorySpanExporter
) -> None:
    from jobrelay.exports.shipped import report_export

    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    app_tracer = provider.get_tracer("shop")
    async with make_pipeline() as p:
        with app_tracer.start_as_current_span("checkout") as checkout:
            async with p.rt.engine.begin() as conn:
                job_id = await report_export.enqueue(
                    conn, {"accountId": "acme", "period": "2020-06"}, account="acme"
                )
        p.start_relay()
        await p.start_worker()
        await p.wait_for(job_id, lambda j: j.state is JobState.SUCCEEDED)
        await p.stop_all()
    found = list(spans.get_finished_spans())
    [enqueue] = _named(found, "enqueue")
    context = checkout.get_span_context()
    assert _hex(enqueue)[0] == f"{context.trace_id:032x}"
    assert _parent(enqueue) == f"{context.span_id:016x}"
    [run] = _named(found, "run report.export")
    assert [li.context.span_id for li in run.links] == [enqueue.context.span_id]
    assert trace.get_current_span() is trace.INVALID_SPAN


async def test_a_run_is_a_child_of_its_enqueue_when_configured(
    make_pipeline: Any, spans: InMemorySpanExporter
) -> None:
    tracing.set_options(tracing.TraceOptions(parent="child", account="omit"))
    try:
        async with make_pipeline() as p:
            job_id = await p.submit(period="2020-07")
            p.start_relay()
            await p.start_worker()
            await p.wait_for(job_id, lambda j: j.state is JobState.SUCCEEDED)
            await p.stop_all()
    finally:
        tracing.set_options(tracing.TraceOptions())
    found = list(spans.get_finished_spans())
    [enqueue] = _named(found, "enqueue")
    [run] = _named(found, "run report.export")
    assert _parent(run) == _hex(enqueue)[1] and not run.links
    assert run.attributes is not None and "jobrelay.account.hash" not in run.attributes


class Empty(BaseModel):
    pass


lab = jobrelay.App()


@lab.job("lab.child", params=Empty)
async def child(ctx: jobrelay.JobContext[Empty], p: Empty) -> None:
    return None


@lab.job("lab.sync_parent", params=Empty)
def sync_parent(ctx: jobrelay.SyncJobContext[Empty], p: Empty) -> None:
    ctx.follow_up(child, Empty())  # on the def job's thread


async def test_a_def_jobs_follow_up_is_enqueued_under_its_run(
    make_pipeline: Any, spans: InMemorySpanExporter
) -> None:
    async with make_pipeline() as p:
        p.rt = dataclasses.replace(p.rt, app=lab)
        parent_id, _ = await p.store.submit(sync_parent.new_job(Empty()), p.rt.clock())
        p.start_relay()
        await p.start_worker()
        await p.wait_for(parent_id, lambda j: j.state is JobState.SUCCEEDED)
        found_jobs = await AdminQueries(p.store).find_jobs(limit=10)
        [follow_up] = [j for j in found_jobs if j.type == "lab.child"]
        await p.wait_for(follow_up.id, lambda j: j.state is JobState.SUCCEEDED)
        await p.stop_all()
    found = list(spans.get_finished_spans())
    [run] = _named(found, "run lab.sync_parent")
    enqueues = [
        s
        for s in _named(found, "enqueue")
        if (s.attributes or {}).get("jobrelay.job.type") == "lab.child"
    ]
    assert len(enqueues) == 1 and _parent(enqueues[0]) == _hex(run)[1]
    [child_run] = _named(found, "run lab.child")
    assert [li.context.span_id for li in child_run.links] == [enqueues[0].context.span_id]


async def test_a_job_written_before_the_trace_column_keeps_its_trace(make_pipeline: Any) -> None:
    from sqlalchemy import update

    from jobrelay.storage.tables import jobs

    from .ops_fixtures import new_job

    async with make_pipeline(faults="export.run:transient:1") as p:
        job = await new_job(p.store, headers={"traceparent": TRACEPARENT})
        job_id, _ = await p.store.submit(job, p.rt.clock())
        async with p.rt.engine.begin() as conn:  # as migration 0020 leaves a finished job
            await conn.execute(update(jobs).where(jobs.c.id == job_id).values(trace_context=None))
        assert await AdminQueries(p.store).trace_id(job_id) == TRACE_ID
        p.start_relay()
        await p.start_worker()
        await p.wait_for(job_id, lambda j: j.state is JobState.SUCCEEDED)
        async with p.rt.engine.connect() as conn:
            from jobrelay.storage.tables import outbox

            rows = (await conn.execute(outbox.select().where(outbox.c.job_id == job_id))).all()
    assert [r.headers.get("traceparent") for r in rows] == [TRACEPARENT, TRACEPARENT]
