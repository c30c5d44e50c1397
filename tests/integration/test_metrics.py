"""Prometheus metrics: what the pipeline counts, the database gauges, the two endpoints, and
that docs/reference/metrics.md names exactly the metrics the code exposes."""

from __future__ import annotations

import asyncio
import dataclasses
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jobrelay.api import create_app
from jobrelay.domain.messages import JobMessage
from jobrelay.domain.states import JobState
from jobrelay.observe.metrics import CONTENT_TYPE, Metrics, refresh_database_gauges, serve_metrics
from jobrelay.runtime.wiring import Runtime
from jobrelay.transport.base import OutgoingMessage
from tests.integration.api_fixtures import T0, Clock, bearer, build_runtime, make_token

from .ops_fixtures import (
    eventually,
    job_in_state,
    kinds,
)

pytestmark = pytest.mark.timeout(90)
DOCS = Path(__file__).parents[2] / "docs" / "reference" / "metrics.md"


def samples(text: bytes | str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a Prometheus text page, keyed by (name, sorted labels)."""
    if isinstance(text, bytes):
        text = text.decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(page: Any, name: str, **labels: str) -> float:
    return page.get((name, tuple(sorted(labels.items()))), 0.0)


async def test_the_pipeline_counts_what_it_does(make_pipeline: Any) -> None:
    faults = "export.run:transient:1@period=2020-01,export.run:invalid@period=2020-02"
    async with make_pipeline(faults=faults) as p:
        retried, invalid, plain = [await p.submit(period=f"2020-0{n}") for n in (1, 2, 3)]
        p.start_relay()
        await p.start_worker()
        for job_id in (retried, plain):
            await p.wait_for(job_id, lambda j: j.state is JobState.SUCCEEDED)
        await p.wait_for(invalid, lambda j: j.state is JobState.QUARANTINED)
        await p.rt.transport.publish(  # a duplicate of a finished job
            OutgoingMessage("work", JobMessage(plain, "report.export").encode())
        )

        async def duplicate_seen() -> bool:
            return "duplicate_acked" in await kinds(p.rt, plain)

        await eventually(duplicate_seen, what="the duplicate to be acked")
        page = samples(p.rt.metrics.render())

    t = "jobrelay_job_transitions_total"
    assert value(page, t, from_state="queued", to_state="running") == 3
    assert value(page, t, from_state="running", to_state="retry_wait") == 1
    assert value(page, t, from_state="retry_wait", to_state="running") == 1
    assert value(page, t, from_state="running", to_state="succeeded") == 2
    assert value(page, t, from_state="running", to_state="quarantined") == 1
    assert value(page, "jobrelay_retries_total") == 1
    assert value(page, "jobrelay_quarantines_total", cause="permanent") == 1
    assert value(page, "jobrelay_duplicates_acked_total") >= 1
    assert value(page, "jobrelay_deliveries_total") >= 5  # 3 + the retry + the duplicate
    duration = "jobrelay_job_duration_seconds_count"
    assert value(page, duration, type="report.export", outcome="succeeded") == 2
    assert value(page, duration, type="report.export", outcome="retry_wait") == 1
    assert value(page, duration, type="report.export", outcome="quarantined") == 1
    assert value(page, "jobrelay_publish_seconds_count", outcome="confirmed") >= 4


async def test_a_redelivery_is_counted(make_pipeline: Any) -> None:
    async with make_pipeline(faults="export.run:crash:1") as p:
        job_id = await p.submit()
        p.start_relay()
        await p.start_worker()
        await p.kill_crashed_worker()
        await p.start_worker()
        await p.wait_for(job_id, lambda j: j.state is JobState.SUCCEEDED, timeout=40)
        page = samples(p.rt.metrics.render())
    assert value(page, "jobrelay_redeliveries_total") >= 1


@pytest.fixture
async def runtime(database_url: str, tmp_path: Path) -> AsyncIterator[Runtime]:
    rt = build_runtime(database_url, tmp_path, clock=Clock())
    yield rt
    await rt.engine.dispose()


async def test_database_gauges(runtime: Runtime) -> None:
    await job_in_state(runtime.store, JobState.QUEUED, T0, "2020-01")
    await job_in_state(runtime.store, JobState.QUARANTINED, T0, "2020-02")
    assert isinstance(runtime.clock, Clock)
    runtime.clock.advance(42)

    await refresh_database_gauges(runtime)

    page = samples(runtime.metrics.render())
    assert value(page, "jobrelay_jobs", state="queued") == 1
    assert value(page, "jobrelay_jobs", state="quarantined") == 1
    assert value(page, "jobrelay_jobs", state="succeeded") == 0
    assert value(page, "jobrelay_outbox_unpublished") == 2
    assert value(page, "jobrelay_outbox_oldest_unpublished_age_seconds") == 42


async def test_api_serves_metrics_with_request_counts(runtime: Runtime) -> None:
    app = create_app(runtime.settings, runtime=runtime)
    transport = httpx.ASGITransport(app=app)
    acme = bearer(await make_token(runtime, "acme"))
    async with httpx.AsyncClient(transport=transport, base_url="http://api.test") as client:
        body = {"accountId": "acme", "period": "2020-05"}
        accepted = await client.post("/v1/exports", json=body, headers=acme)
        job_id = accepted.json()["jobId"]
        assert (await client.get(f"/v1/jobs/{job_id}", headers=acme)).status_code == 200
        response = await client.get("/metrics")

    assert response.status_code == 200
    assert response.headers["content-type"] == CONTENT_TYPE
    page = samples(response.text)
    requests = "jobrelay_http_requests_total"
    assert value(page, requests, method="POST", route="/v1/exports", status="202") == 1
    assert value(page, requests, method="GET", route="/v1/jobs/{jobId}", status="200") == 1
    assert not any(job_id in str(key) for key in page)  # ids never become label values
    assert value(page, "jobrelay_job_transitions_total", from_state="new", to_state="queued") == 1
    assert value(page, "jobrelay_jobs", state="queued") == 1


async def test_metrics_port_serves_prometheus_text_even_when_refresh_fails(
    unused_tcp_port: int,
) -> None:
    metrics = Metrics()
    metrics.retries.inc()
    stop, started = asyncio.Event(), asyncio.Event()

    async def failing_refresh() -> None:
        raise RuntimeError("database down")

    server = asyncio.create_task(
        serve_metrics(
            metrics, "127.0.0.1", unused_tcp_port, stop, refresh=failing_refresh, started=started
        )
    )
    try:
        await asyncio.wait_for(started.wait(), 10)
        base = f"http://127.0.0.1:{unused_tcp_port}"
        async with httpx.AsyncClient(base_url=base, timeout=5) as client:
            page = await client.get("/metrics")
            missing = await client.get("/nothing")
            health = await client.get("/healthz")
            probe = await client.head("/healthz")
    finally:
        stop.set()
        await asyncio.wait_for(server, 10)
    assert page.status_code == 200 and page.headers["content-type"] == CONTENT_TYPE
    assert value(samples(page.text), "jobrelay_retries_total") == 1
    assert missing.status_code == 404 and health.status_code == 200
    assert probe.status_code == 200 and probe.content == b""


def test_every_metric_is_documented_and_every_documented_metric_exists() -> None:
    documented = set(re.findall(r"^\| `(jobrelay_[a-z_]+)`", DOCS.read_text(), re.MULTILINE))
    assert documented == set(Metrics().names())


# --- cached figures, optionally behind a token (issue 25, item 7) --------------------------


async def test_scrapes_read_the_database_gauges_at_most_once_per_cache_period(
    runtime: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads = 0
    count = runtime.store.count_by_state

    async def counted() -> dict[str, int]:
        nonlocal reads
        reads += 1
        return await count()

    monkeypatch.setattr(runtime.store, "count_by_state", counted)
    assert runtime.settings.metrics_cache_seconds == 5.0  # the default
    assert isinstance(runtime.clock, Clock)
    app = create_app(runtime.settings, runtime=runtime)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://api.test") as client:
        pages = await asyncio.gather(*(client.get("/metrics") for _ in range(10)))
        assert reads == 1  # ten concurrent scrapes, one GROUP BY
        await job_in_state(runtime.store, JobState.QUEUED, T0, "2020-01")
        runtime.clock.advance(4.9)
        cached = await client.get("/metrics")
        runtime.clock.advance(0.2)
        fresh = await client.get("/metrics")
    assert {p.status_code for p in pages} == {200}
    assert value(samples(cached.text), "jobrelay_jobs", state="queued") == 0
    assert value(samples(fresh.text), "jobrelay_jobs", state="queued") == 1
    assert reads == 2


async def test_a_metrics_token_guards_both_metrics_endpoints(
    runtime: Runtime, unused_tcp_port: int
) -> None:
    secret = "m" * 32
    settings = runtime.settings.model_copy(update={"metrics_token": secret})
    app = create_app(settings, runtime=dataclasses.replace(runtime, settings=settings))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://api.test") as client:
        anonymous = await client.get("/metrics")
        wrong = await client.get("/metrics", headers={"Authorization": "Bearer " + "n" * 32})
        right = await client.get("/metrics", headers={"Authorization": f"Bearer {secret}"})
    assert anonymous.status_code == 401 and wrong.status_code == 401
    assert anonymous.headers["content-type"].startswith("application/problem+json")
    assert right.status_code == 200 and "jobrelay_jobs" in right.text

    stop, started = asyncio.Event(), asyncio.Event()
    server = asyncio.create_task(
        serve_metrics(
            runtime.metrics, "127.0.0.1", unused_tcp_port, stop, started=started, token=secret
        )
    )
    try:
        await asyncio.wait_for(started.wait(), 10)
        base = f"http://127.0.0.1:{unused_tcp_port}"
        async with httpx.AsyncClient(base_url=base, timeout=5) as client:
            port_anonymous = await client.get("/metrics")
            port_right = await client.get("/metrics", headers={"Authorization": f"Bearer {secret}"})
            port_health = await client.get("/healthz")
    finally:
        stop.set()
        await asyncio.wait_for(server, 10)
    assert port_anonymous.status_code == 401 and b"jobrelay_" not in port_anonymous.content
    assert port_right.status_code == 200 and "jobrelay_jobs" in port_right.text
    assert port_health.status_code == 200  # health checks need no token
