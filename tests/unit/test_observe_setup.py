"""The log format for people and the tracing set-up from the standard variables (issue 39):
text for a terminal and JSON otherwise unless ``JOBRELAY_LOG_FORMAT`` says; no exporter
named, no provider and no SDK imported; ``console`` installs one; the carried context."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys

import pytest
from opentelemetry.sdk.trace import TracerProvider

from jobrelay.errors import ConfigError
from jobrelay.observe import logs, tracing
from jobrelay.settings import load_settings


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def _record(**extra: object) -> logging.LogRecord:
    record = logging.LogRecord("jobrelay.worker", logging.INFO, "", 0, "job claimed", None, None)
    record.__dict__.update(extra)
    return record


def test_a_terminal_gets_text_and_anything_else_json() -> None:
    assert logs.text_by_default(Tty())
    assert not logs.text_by_default(io.StringIO())


def test_the_text_line_reads_time_level_event_job_and_message_then_the_rest() -> None:
    line = logs.TextFormatter("worker").format(_record(event="claimed", jobId="j-1", attempt=2))
    head, rest = line.split("  [")
    assert head.split()[1:] == ["INFO", "worker", "claimed", "j-1", "job", "claimed"]
    assert rest == "attempt=2]"


def test_a_line_inside_a_span_carries_its_trace_and_span_ids() -> None:
    provider = TracerProvider()
    with provider.get_tracer("t").start_as_current_span("run") as span:
        entry = json.loads(logs.JsonFormatter("worker").format(_record(event="claimed")))
        text = logs.TextFormatter("worker").format(_record(event="claimed"))
    context = span.get_span_context()
    assert entry["trace_id"] == f"{context.trace_id:032x}"
    assert entry["span_id"] == f"{context.span_id:016x}"
    assert f"trace_id={context.trace_id:032x}" in text
    assert "trace_id" not in json.loads(logs.JsonFormatter("w").format(_record()))


def test_log_format_and_trace_url_are_checked_settings() -> None:
    assert load_settings(log_format="text").log_format == "text"
    with pytest.raises(ConfigError):
        load_settings(log_format="xml")
    with pytest.raises(ConfigError, match="trace_id"):
        load_settings(trace_url="https://tempo.example/trace/")


def _configured(**env: str) -> dict[str, object]:
    """What ``configure`` does in a fresh process with ``env`` (none of the machine's OTEL_*)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    code = (
        "import json, sys\n"
        "from jobrelay.observe import exporters, tracing\n"
        "provider = exporters.configure('worker')\n"
        "print(json.dumps({'sdk': 'opentelemetry.sdk' in sys.modules,"
        " 'active': tracing.active(), 'made': provider is not None}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def test_no_exporter_named_installs_nothing_and_imports_no_sdk() -> None:
    assert _configured() == {"sdk": False, "active": False, "made": False}
    assert _configured(OTEL_TRACES_EXPORTER="none") == {
        "sdk": False,
        "active": False,
        "made": False,
    }


def test_a_named_exporter_installs_the_provider() -> None:
    assert _configured(OTEL_TRACES_EXPORTER="console") == {
        "sdk": True,
        "active": True,
        "made": True,
    }
    # An OTLP endpoint alone names the OTLP exporter.
    assert _configured(OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:9")["active"] is True


def test_without_spans_the_callers_context_is_carried_as_it_came() -> None:
    parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    headers = {"traceparent": parent, "tracestate": "vendor=1", "x-other": "kept apart"}
    assert tracing.trace_headers(headers) == {"traceparent": parent, "tracestate": "vendor=1"}
    assert tracing.trace_id_of(headers) == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert tracing.trace_id_of({"traceparent": "garbage"}) is None
    with tracing.request_context({"traceparent": parent}):
        assert tracing.carrier()["traceparent"] == parent
    assert tracing.carrier() == {}


def test_one_of_a_batch_with_a_trace_of_its_own_keeps_it() -> None:
    from jobrelay.storage.records import NewJob

    def job(n: int, trace: str | None) -> NewJob:
        headers = {"traceparent": trace, "x-keep": "yes"} if trace else None
        return NewJob(f"j{n}", "t", None, {}, "h", 3, headers=headers)

    first = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    own = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    with tracing.enqueuing([job(1, first), job(2, None), job(3, own)]) as written:
        traces = [tracing.trace_id_of(j.headers) for j in written]
    assert traces == [first.split("-")[1], first.split("-")[1], own.split("-")[1]]
    assert written[2].headers is not None and written[2].headers["x-keep"] == "yes"
