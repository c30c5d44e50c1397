"""What the tests of traces and logs read: every log line as the stderr handler writes it
(JSON and text, bound context and trace ids included), and the spans of an in-memory
exporter given to ``tracing.use`` (the global provider is never set: it could not be unset)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from jobrelay.observe import tracing
from jobrelay.observe.logs import JsonFormatter, TextFormatter


class LogLines(logging.Handler):
    """Formats each record as it is emitted, in both formats."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.json, self.text = JsonFormatter("test"), TextFormatter("test")
        self.lines: list[str] = []  # JSON
        self.text_lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.json.format(record))
        self.text_lines.append(self.text.format(record))

    def entries(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.lines]


@pytest.fixture
def json_lines() -> Iterator[LogLines]:
    # Each job's lifecycle lines are DEBUG (JOBRELAY_LOG_LEVEL=DEBUG); INFO has a summary
    # per batch of settles.
    handler = LogLines()
    root, ours = logging.getLogger(), logging.getLogger("jobrelay")
    root.addHandler(handler)
    ours.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        ours.setLevel(logging.NOTSET)
        root.removeHandler(handler)


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use(provider)
    try:
        yield exporter
    finally:
        tracing.use(None)
        provider.shutdown()
