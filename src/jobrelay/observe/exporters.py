"""The tracer provider a jobrelay process makes from the standard ``OTEL_*`` variables.

Apart from ``observe.tracing`` (the spans the pipeline makes): this runs once, at a
process's start (``observe.setup``), and imports the OpenTelemetry SDK only when an exporter
is named.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from opentelemetry import trace

from jobrelay.observe import tracing

log = logging.getLogger("jobrelay.tracing")


def configure(process: str) -> Any:
    """Tracing from the standard environment variables, if the ``otel`` extra is installed
    and the application set no provider of its own; the provider made (to shut down at
    exit), or None.

    ``OTEL_TRACES_EXPORTER``: ``otlp`` (HTTP/protobuf to ``OTEL_EXPORTER_OTLP_ENDPOINT`` or
    ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``), ``console`` (stdout), ``none``; a comma list for
    several. Unset: ``otlp`` when an OTLP endpoint is set, otherwise nothing is exported and
    no span is made (jobrelay sends nothing anywhere that was not named). The service name,
    resource attributes and sampler are the SDK's own variables (``OTEL_SERVICE_NAME``,
    ``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_TRACES_SAMPLER``/``_ARG``).
    """
    if tracing.active():
        return None  # the application's own provider
    names = exporters_named()
    if not names:
        return None
    try:
        from opentelemetry.sdk.resources import OTELResourceDetector, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
    except ImportError:
        log.warning(
            "OTEL_TRACES_EXPORTER is set but the OpenTelemetry SDK is not installed: "
            "pip install 'jobrelay[otel]'",
            extra={"event": "tracing_unavailable"},
        )
        return None
    resource = Resource.create({"service.name": f"jobrelay-{process}"}).merge(
        OTELResourceDetector().detect()
    )
    provider = TracerProvider(resource=resource)
    for name in names:
        if name == "console":
            provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
        elif name == "otlp":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        else:
            log.warning(
                "OTEL_TRACES_EXPORTER names %r, which jobrelay does not know (otlp, console, none)",
                name,
                extra={"event": "tracing_unavailable"},
            )
    trace.set_tracer_provider(provider)
    tracing.provider_set()
    return provider


def exporters_named() -> list[str]:
    raw = os.environ.get("OTEL_TRACES_EXPORTER")
    if raw is None:
        endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get(
            "OTEL_EXPORTER_OTLP_ENDPOINT"
        )
        return ["otlp"] if endpoint else []
    return [n for n in (part.strip().lower() for part in raw.split(",")) if n and n != "none"]
