"""What a jobrelay process does about its logs and traces at start, from one settings object."""

from __future__ import annotations

from typing import TYPE_CHECKING

from jobrelay.observe import exporters, logs, tracing

if TYPE_CHECKING:
    from jobrelay.settings import Settings


def observe(process: str, settings: Settings, level: str | None = None) -> None:
    """The log lines (level, format) and tracing (``observe.exporters.configure``: the
    ``OTEL_*`` variables, or the application's own provider) of ``process``."""
    logs.configure(process, level or settings.log_level, settings.log_format)
    tracing.set_options(tracing.TraceOptions(settings.otel_parent, settings.otel_account))
    exporters.configure(process)
