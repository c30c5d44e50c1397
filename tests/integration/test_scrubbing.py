"""One scrubber everywhere (issue 39): a job whose exception quotes a database password never
shows it unmasked in its last error, its quarantine reason, its attempts, its timeline, ``job
show`` (text and JSON), the operators' HTTP view (what the console renders), a log line, a
span or a span event; rows written before the scrubber existed are masked when shown."""

from __future__ import annotations

import dataclasses
import io
import json
import logging
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from pydantic import BaseModel
from rich.console import Console
from sqlalchemy import update

import jobrelay
from jobrelay.admin import explain, job_list
from jobrelay.api import create_app
from jobrelay.domain.states import JobState
from jobrelay.observe.logs import JsonFormatter
from jobrelay.observe.scrub import scrub
from jobrelay.storage.tables import job_events, jobs

from .api_fixtures import bearer, make_token
from .trace_fixtures import LogLines

pytestmark = pytest.mark.timeout(120)

SECRET = "s3cretPa55"
DSN = f"postgresql://ledger:{SECRET}@db.internal:5432/ledger"


class Nothing(BaseModel):
    pass


app = jobrelay.App()


@app.job("lab.leaky", params=Nothing, max_attempts=2, retry_delays=(1,))
async def leaky(ctx: jobrelay.JobContext[Nothing], p: Nothing) -> None:
    raise ConnectionError(f"could not connect to {DSN}: timeout")


def _shown(job: Any, events: Any, now: Any) -> str:
    out = io.StringIO()
    saved = explain.console
    explain.console = Console(file=out, width=300, highlight=False)
    try:
        explain.render_job(job, events, now)
        explain.render_traceback(job, True)
    finally:
        explain.console = saved
    return out.getvalue()


async def test_a_password_in_an_exception_reaches_no_view_line_or_span(
    make_pipeline: Any, json_lines: LogLines, spans: InMemorySpanExporter
) -> None:
    async with make_pipeline() as p:
        p.rt = dataclasses.replace(p.rt, app=app)
        job_id, _ = await p.store.submit(leaky.new_job(Nothing(), account="acme"), p.rt.clock())
        p.start_relay()
        await p.start_worker()
        job = await p.wait_for(job_id, lambda j: j.state is JobState.QUARANTINED)
        await p.stop_all()
        events = await p.store.events(job_id)
        token = await make_token(p.rt, None, admin=True)
        api = create_app(p.rt.settings, runtime=p.rt)
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=api), base_url="http://api"
        ) as client:
            view = await client.get(f"/v1/jobs/{job_id}/explain", headers=bearer(token))
            listed = await client.get("/v1/jobs?state=quarantined", headers=bearer(token))
            one = await client.get(f"/v1/jobs/{job_id}", headers=bearer(token))
        now = p.rt.clock()

    assert view.status_code == 200, view.text
    # What was stored is masked at write, and still says what happened.
    for text in (job.last_error, job.quarantine_reason, job.last_traceback):
        assert text is not None and SECRET not in text and "ledger:***@db.internal" in text
    stored = json.dumps([e.detail for e in events])
    assert SECRET not in stored
    document = explain.explain_document(job, events, now)
    assert [a["error"] for a in document["attempts"]] and SECRET not in json.dumps(document)
    assert SECRET not in _shown(job, events, now)
    assert SECRET not in view.text and "ledger:***@" in view.text
    for answer in (listed, one):  # the console's lists, the job itself
        assert answer.status_code == 200 and "ledger:***@" in answer.text, answer.text
        assert SECRET not in answer.text
    every_line = json_lines.lines + json_lines.text_lines
    assert every_line and not [line for line in every_line if SECRET in line]
    for span in spans.get_finished_spans():
        assert SECRET not in json.dumps(dict(span.attributes or {})), span.name
        assert SECRET not in (span.status.description or ""), span.name
        for event in span.events:
            assert SECRET not in json.dumps(dict(event.attributes or {})), event.name


async def test_rows_written_before_the_scrubber_are_masked_when_shown(
    make_pipeline: Any,
) -> None:
    async with make_pipeline() as p:
        job_id = await p.submit(period="2020-08")
        async with p.rt.engine.begin() as conn:
            await conn.execute(
                update(jobs)
                .where(jobs.c.id == job_id)
                .values(
                    last_error=f"unexpected OperationalError: {DSN}",
                    quarantine_reason=f"unexpected OperationalError: {DSN}",
                    last_traceback=f"Traceback ...\nOperationalError: {DSN}\n",
                )
            )
            await conn.execute(
                job_events.insert().values(
                    job_id=job_id,
                    at=p.rt.clock(),
                    kind="retry_scheduled",
                    detail={"reason": f"password={SECRET} host=db", "attempt": 1},
                )
            )
        job = await p.store.get_job(job_id)
        events = await p.store.events(job_id)
        now = p.rt.clock()
        token = await make_token(p.rt, None, admin=True)
        api = create_app(p.rt.settings, runtime=p.rt)
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=api), base_url="http://api"
        ) as client:
            answers = [
                await client.get(path, headers=bearer(token))
                for path in (f"/v1/jobs/{job_id}", "/v1/jobs?state=queued")
            ]
    for answer in answers:
        assert answer.status_code == 200 and "ledger:***@" in answer.text, answer.text
        assert SECRET not in answer.text
    listed = io.StringIO()
    saved = job_list.console
    job_list.console = Console(file=listed, width=300)
    try:
        job_list.render_jobs([job], now)
    finally:
        job_list.console = saved
    assert "ledger:***@" in listed.getvalue() and SECRET not in listed.getvalue()
    text = _shown(job, events, now)
    assert SECRET not in text and "ledger:***@" in text and "password=***" in text
    assert SECRET not in json.dumps(explain.explain_document(job, events, now))


@pytest.mark.parametrize(
    ("raw", "masked"),
    [
        (DSN, "postgresql://ledger:***@db.internal:5432/ledger"),
        ("amqp://u:p@ss@rabbit/vh", "amqp://u:***@rabbit/vh"),
        ("host=db password=hunter2 user=app", "host=db password=*** user=app"),
        ("Authorization: Bearer abcdefgh12345678", "Authorization: Bearer ***"),
        ("token jr_0123456789abcdefghij", "token jr_***"),
        ("https://example.com/path?q=1", "https://example.com/path?q=1"),
        ('login with password="s3cret" ok', "login with password=*** ok"),
        ("PGPASSWORD=x1 DB_PASSWORD=y2", "PGPASSWORD=*** DB_PASSWORD=***"),
        ("{'password': 'x'}", "{'password': ***}"),
        ("https://host:8443/p@x", "https://host:8443/p@x"),
    ],
)
def test_the_scrubber_masks_each_kind_of_secret_and_keeps_the_rest(raw: str, masked: str) -> None:
    assert scrub(raw) == masked


@pytest.mark.parametrize(
    "message", ['invalid dsn: "host=db password=s3cret"', 'login with password="s3cret"']
)
def test_a_json_line_with_a_quoted_password_is_still_json_and_masked(message: str) -> None:
    record = logging.LogRecord("jobrelay.worker", logging.WARNING, "", 0, message, None, None)
    line = JsonFormatter("worker").format(record)
    assert "s3cret" not in line
    assert "password=***" in json.loads(line)["msg"]
