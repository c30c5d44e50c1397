"""A local OTLP/HTTP trace receiver: what a collector would get from jobrelay's processes.

It listens on loopback only, decodes each ``POST /v1/traces`` (protobuf, as the SDK's
``OTLPSpanExporter`` sends it) with OpenTelemetry's own message types, and keeps the spans
as plain records the tests (and ``make bench``'s traced drain) read.
"""

from __future__ import annotations

import gzip
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


@dataclass
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: int
    attributes: dict[str, Any]
    events: list[tuple[str, int, dict[str, Any]]]
    links: list[tuple[str, str]]  # (trace id, span id)
    status: tuple[int, str]
    start_ns: int
    end_ns: int


@dataclass
class Receiver:
    url: str
    spans: list[ReceivedSpan] = field(default_factory=list)
    requests: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, body: bytes) -> None:
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        found: list[ReceivedSpan] = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            service = str(resource.get("service.name", ""))
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    found.append(
                        ReceivedSpan(
                            service=service,
                            name=s.name,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_id=s.parent_span_id.hex(),
                            kind=s.kind,
                            attributes={a.key: _value(a.value) for a in s.attributes},
                            events=[
                                (
                                    e.name,
                                    e.time_unix_nano,
                                    {a.key: _value(a.value) for a in e.attributes},
                                )
                                for e in s.events
                            ],
                            links=[(li.trace_id.hex(), li.span_id.hex()) for li in s.links],
                            status=(s.status.code, s.status.message),
                            start_ns=s.start_time_unix_nano,
                            end_ns=s.end_time_unix_nano,
                        )
                    )
        with self.lock:
            self.spans.extend(found)
            self.requests += 1

    def snapshot(self) -> list[ReceivedSpan]:
        with self.lock:
            return list(self.spans)


@contextmanager
def otlp_receiver() -> Iterator[Receiver]:
    """A receiver on a free loopback port; its ``url`` is what ``OTEL_EXPORTER_OTLP_ENDPOINT``
    names (the exporter adds ``/v1/traces``)."""
    holder: list[Receiver] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            if self.path != "/v1/traces":
                self.send_response(404)
                self.end_headers()
                return
            holder[0].add(body)
            reply = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    holder.append(Receiver(f"http://127.0.0.1:{server.server_address[1]}"))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield holder[0]
    finally:
        server.shutdown()
        server.server_close()
