"""jobrelay: background jobs that never silently disappear and never silently happen twice.

The library's public names. Define job types on an ``App`` with ``@app.job`` and enqueue
them inside your own transaction; ``jobrelay worker --app pkg.module:app`` runs them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jobrelay.app import App
    from jobrelay.context import JobContext, Result
    from jobrelay.domain.states import JobState
    from jobrelay.errors import (
        ConfigError,
        IdempotencyConflict,
        InvalidParams,
        InvalidRunTime,
        JobrelayError,
        Permanent,
        Retry,
    )
    from jobrelay.job_definition import JobDefinition
    from jobrelay.periodic import Schedule
    from jobrelay.results.base import ResultWriter
    from jobrelay.settings import Settings
    from jobrelay.storage.engine import create_engine
    from jobrelay.storage.records import JobRecord as Job
    from jobrelay.sync_context import SyncJobContext

# Each public name and the module that holds it. Imported on first use (PEP 562), so that
# `import jobrelay.cli` or `jobrelay --help` does not pay for SQLAlchemy, aio-pika and the
# app machinery a command may never touch.
_EXPORTS = {
    "App": "jobrelay.app",
    "JobDefinition": "jobrelay.job_definition",
    "JobContext": "jobrelay.context",
    "Result": "jobrelay.context",
    "JobState": "jobrelay.domain.states",
    "ConfigError": "jobrelay.errors",
    "IdempotencyConflict": "jobrelay.errors",
    "InvalidParams": "jobrelay.errors",
    "InvalidRunTime": "jobrelay.errors",
    "JobrelayError": "jobrelay.errors",
    "Permanent": "jobrelay.errors",
    "Retry": "jobrelay.errors",
    "Schedule": "jobrelay.periodic",
    "ResultWriter": "jobrelay.results.base",
    "Settings": "jobrelay.settings",
    "create_engine": "jobrelay.storage.engine",
    "Job": "jobrelay.storage.records",
    "SyncJobContext": "jobrelay.sync_context",
}
_ATTRIBUTE = {"Job": "JobRecord"}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'jobrelay' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), _ATTRIBUTE.get(name, name))
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__all__ = [
    "App",
    "ConfigError",
    "IdempotencyConflict",
    "InvalidParams",
    "InvalidRunTime",
    "Job",
    "JobContext",
    "JobDefinition",
    "JobState",
    "JobrelayError",
    "Permanent",
    "Result",
    "ResultWriter",
    "Retry",
    "Schedule",
    "Settings",
    "SyncJobContext",
    "create_engine",
]
__version__ = "0.1.0"
