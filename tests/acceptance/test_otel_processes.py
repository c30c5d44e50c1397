"""OpenTelemetry across real processes (issue 39): an export accepted over HTTP is one trace
in a local OTLP/HTTP receiver, from the API's request span and its enqueue through the
relay's publish to the worker's run with its claim, commit and ack, on PostgreSQL + RabbitMQ
with three processes and on ``jobrelay up``; ``OTEL_TRACES_EXPORTER=console`` prints a
process's spans on its stdout."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.otlp_receiver import ReceivedSpan, Receiver, otlp_receiver

from .procs import FAST_ENV, clean_env, free_port, poll, processes, run_cli, wait_http

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"


def _otel(receiver: Receiver) -> dict[str, str]:
    return {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
        "OTEL_BSP_SCHEDULE_DELAY": "100",  # ms: the processes send their spans at once
    }


def _ok(*args: str, env: dict[str, str]) -> str:
    done = run_cli(*args, env=env)
    assert done.returncode == 0, done.stderr
    return done.stdout


def _export(base: str, env: dict[str, str]) -> str:
    secret = _ok("token", "create", "--account", "acme", env=env).strip().splitlines()[-1]
    response = httpx.post(
        f"{base}/v1/exports",
        json={"accountId": "acme", "period": "2020-05"},
        headers={"Authorization": f"Bearer {secret}", "traceparent": TRACEPARENT},
        timeout=10,
    )
    assert response.status_code == 202, response.text
    job_id = str(response.json()["jobId"])
    poll(
        lambda: json.loads(_ok("job", "show", job_id, "--json", env=env))["state"] == "succeeded",
        60,
        f"job {job_id} to succeed",
    )
    return job_id


def _one(spans: list[ReceivedSpan], name: str) -> ReceivedSpan:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, (name, [(s.name, s.service) for s in spans])
    return found[0]


def _check_trace(receiver: Receiver, job_id: str, services: dict[str, str]) -> None:
    """The spans of one export: ``services`` names the process each kind comes from."""

    def complete() -> list[ReceivedSpan] | None:
        spans = receiver.snapshot()
        names = {s.name for s in spans}
        wanted = {"POST /v1/exports", "enqueue", "publish", "run report.export", "ack"}
        return spans if wanted <= names else None

    spans = poll(complete, 30, "the processes' spans at the receiver")
    request = _one(spans, "POST /v1/exports")
    enqueue = _one(spans, "enqueue")
    publish = _one(spans, "publish")
    run = _one(spans, "run report.export")
    assert (request.service, enqueue.service) == (services["api"], services["api"])
    assert publish.service == services["relay"] and run.service == services["worker"]
    # One trace from the caller's traceparent to the publish; the run linked to the enqueue.
    assert request.trace_id == enqueue.trace_id == publish.trace_id == TRACE_ID
    assert request.parent_id == TRACEPARENT.split("-")[2]
    assert enqueue.parent_id == request.span_id and publish.parent_id == enqueue.span_id
    assert run.links == [(TRACE_ID, enqueue.span_id)]
    children = {s.name: s for s in spans if s.parent_id == run.span_id}
    assert set(children) == {"claim", "commit", "ack"}, sorted(children)
    for span in (enqueue, publish, run, *children.values()):
        assert span.attributes["messaging.message.id"] == job_id, span.name
    assert [e[0] for e in run.events] == ["claimed", "result_saved", "ack_sent"]
    assert run.attributes["messaging.system"] == "jobrelay"
    assert "published" in [e[0] for e in publish.events]


def test_three_processes_on_postgres_and_rabbitmq_send_one_trace(
    tmp_path: Path, pg_url: str, amqp_url: str
) -> None:
    with otlp_receiver() as receiver:
        env = clean_env(
            JOBRELAY_DATABASE_URL=pg_url,
            JOBRELAY_BROKER_URL=amqp_url,
            JOBRELAY_RESULTS_URL=f"file://{tmp_path}/exports",
            **FAST_ENV,
        )
        _ok("seed", "--rows-per-month", "20", env=env)
        traced = {**env, **_otel(receiver)}
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        with processes(tmp_path) as start:
            api = start("api", "api", "--port", str(port), env=traced)
            relay = start("relay", "relay", env=traced)
            worker = start("worker", "worker", env=traced)
            wait_http(base, api)
            job_id = _export(base, env)
            # Each process sends what it has when it stops (and every 100 ms before).
            for proc in (api, relay, worker):
                proc.stop()
        _check_trace(
            receiver,
            job_id,
            {"api": "jobrelay-api", "relay": "jobrelay-relay", "worker": "jobrelay-worker"},
        )


def test_jobrelay_up_sends_one_trace(tmp_path: Path, sqlite_template: Path) -> None:
    shutil.copy(sqlite_template, tmp_path / "jr.db")
    with otlp_receiver() as receiver:
        env = clean_env(
            JOBRELAY_DATABASE_URL=f"sqlite:///{tmp_path}/jr.db",
            JOBRELAY_RESULTS_URL=f"file://{tmp_path}/exports",
            **FAST_ENV,
        )
        _ok("seed", "--rows-per-month", "20", env=env)
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        with processes(tmp_path) as start:
            up = start(
                "up",
                "up",
                "--port",
                str(port),
                env={**env, **_otel(receiver), "OTEL_SERVICE_NAME": "shop-jobs"},
            )
            wait_http(base, up)
            job_id = _export(base, env)
            up.stop()
        # OTEL_SERVICE_NAME names the service, as the SDK's own variable does.
        _check_trace(
            receiver, job_id, {"api": "shop-jobs", "relay": "shop-jobs", "worker": "shop-jobs"}
        )


def test_the_console_exporter_prints_a_processs_spans(
    tmp_path: Path, sqlite_template: Path
) -> None:
    shutil.copy(sqlite_template, tmp_path / "jr.db")
    env = clean_env(
        JOBRELAY_DATABASE_URL=f"sqlite:///{tmp_path}/jr.db",
        JOBRELAY_RESULTS_URL=f"file://{tmp_path}/exports",
        OTEL_TRACES_EXPORTER="console",
        **FAST_ENV,
    )
    done = run_cli("demo", env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    spans: list[dict[str, Any]] = []
    decoder = json.JSONDecoder()
    text, at = done.stdout, 0
    while (start := text.find("{\n", at)) != -1:
        value, at = decoder.raw_decode(text, start)
        spans.append(value)
    names = {s["name"] for s in spans}
    assert {"enqueue", "publish", "run report.export", "claim", "ack"} <= names, names
    assert all(s["resource"]["attributes"]["service.name"] == "jobrelay-demo" for s in spans)
