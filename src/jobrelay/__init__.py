"""jobrelay: background jobs that never silently disappear and never silently happen twice.

The library's public names. Define job types on an ``App`` with ``@app.job`` and enqueue
them inside your own transaction; ``jobrelay worker --app pkg.module:app`` runs them.
"""

from jobrelay.app import App, JobDefinition
from jobrelay.context import JobContext, Result
from jobrelay.domain.states import JobState
from jobrelay.errors import (
    IdempotencyConflict,
    InvalidParams,
    JobrelayError,
    Permanent,
    Retry,
)
from jobrelay.periodic import Schedule
from jobrelay.results.base import ResultWriter
from jobrelay.settings import Settings
from jobrelay.storage.engine import create_engine
from jobrelay.storage.records import JobRecord as Job

__all__ = [
    "App",
    "IdempotencyConflict",
    "InvalidParams",
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
    "create_engine",
]
__version__ = "0.1.0"
