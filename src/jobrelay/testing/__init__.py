"""Testing an application's jobs: ``run_jobs`` runs them in the test's process with the real
relay and worker on a database of the test's own; ``enqueued`` records what application code
enqueues without running it; ``FakeClock`` is the time both read. docs/how-to/testing.md.

Imported on first use (PEP 562): the pytest plugin (``jobrelay.testing.plugin``) loads this
package in every test session of a project that installed jobrelay, and must cost nothing
until a test asks for a runner.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jobrelay.testing.clock import FakeClock
    from jobrelay.testing.runner import DrainTimeout, Runner, enqueued, run_jobs

_EXPORTS = {
    "FakeClock": "jobrelay.testing.clock",
    "DrainTimeout": "jobrelay.testing.runner",
    "Runner": "jobrelay.testing.runner",
    "enqueued": "jobrelay.testing.runner",
    "run_jobs": "jobrelay.testing.runner",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'jobrelay.testing' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__all__ = ["DrainTimeout", "FakeClock", "Runner", "enqueued", "run_jobs"]
