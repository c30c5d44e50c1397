"""jobrelay: background jobs that never silently disappear and never silently happen twice.

The library's public names. Define job types on an ``App`` with ``@app.job`` and enqueue
them inside your own transaction; ``jobrelay worker --app pkg.module:app`` runs them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jobrelay.domain.backoff import Backoff
    from jobrelay.domain.states import JobState
    from jobrelay.errors import (
        ConfigError,
        IdempotencyConflict,
        InvalidDependencies,
        InvalidParams,
        InvalidRunTime,
        JobFailed,
        JobNotFound,
        JobrelayError,
        Permanent,
        Retry,
    )
    from jobrelay.library.app import App
    from jobrelay.library.context import JobContext, Result
    from jobrelay.library.job_definition import JobDefinition
    from jobrelay.library.limits import ConcurrencyLimit, RateLimit
    from jobrelay.library.periodic import Schedule
    from jobrelay.library.sync_context import SyncJobContext
    from jobrelay.results.base import ResultWriter
    from jobrelay.settings import Settings
    from jobrelay.storage.engine import create_engine
    from jobrelay.storage.records import JobRecord as Job

# Each public name and the module that holds it. Imported on first use (PEP 562), so that
# `import jobrelay.cli` or `jobrelay --help` does not pay for SQLAlchemy, aio-pika and the
# app machinery a command may never touch.
_EXPORTS = {
    "App": "jobrelay.library.app",
    "Backoff": "jobrelay.domain.backoff",
    "ConcurrencyLimit": "jobrelay.library.limits",
    "RateLimit": "jobrelay.library.limits",
    "JobDefinition": "jobrelay.library.job_definition",
    "JobContext": "jobrelay.library.context",
    "Result": "jobrelay.library.context",
    "JobState": "jobrelay.domain.states",
    "ConfigError": "jobrelay.errors",
    "IdempotencyConflict": "jobrelay.errors",
    "InvalidDependencies": "jobrelay.errors",
    "InvalidParams": "jobrelay.errors",
    "InvalidRunTime": "jobrelay.errors",
    "JobFailed": "jobrelay.errors",
    "JobNotFound": "jobrelay.errors",
    "JobrelayError": "jobrelay.errors",
    "Permanent": "jobrelay.errors",
    "Retry": "jobrelay.errors",
    "Schedule": "jobrelay.library.periodic",
    "ResultWriter": "jobrelay.results.base",
    "Settings": "jobrelay.settings",
    "create_engine": "jobrelay.storage.engine",
    "Job": "jobrelay.storage.records",
    "SyncJobContext": "jobrelay.library.sync_context",
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
    "Backoff",
    "ConcurrencyLimit",
    "ConfigError",
    "IdempotencyConflict",
    "InvalidDependencies",
    "InvalidParams",
    "InvalidRunTime",
    "Job",
    "JobContext",
    "JobDefinition",
    "JobFailed",
    "JobNotFound",
    "JobState",
    "JobrelayError",
    "Permanent",
    "RateLimit",
    "Result",
    "ResultWriter",
    "Retry",
    "Schedule",
    "Settings",
    "SyncJobContext",
    "create_engine",
]
__version__ = "0.1.0"
