"""jobrelay's pytest plugin (entry point ``pytest11``): the ``jobrelay_runner`` and
``jobrelay_enqueued`` fixtures, for the App a project's ``jobrelay_app`` fixture returns.

Loaded in every pytest session where jobrelay is installed, so it imports nothing heavy: the
runner's machinery is imported when a test first asks for a fixture.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from jobrelay.testing.runner import Runner

try:
    import pytest_asyncio

    ASYNC_FIXTURES = True
except ImportError:  # pragma: no cover - a project without pytest-asyncio
    ASYNC_FIXTURES = False


@pytest.fixture
def jobrelay_app() -> Any:
    """Override in your conftest.py: return your ``jobrelay.App``."""
    raise pytest.UsageError(
        "jobrelay_runner runs the App a fixture named `jobrelay_app` returns: define it in "
        "your conftest.py (`@pytest.fixture\\ndef jobrelay_app(): return app`)"
    )


if ASYNC_FIXTURES:

    @pytest_asyncio.fixture
    async def jobrelay_runner(jobrelay_app: Any) -> AsyncIterator[Runner]:
        """``run_jobs(jobrelay_app)``: the app's jobs run by a real relay and worker on a
        fresh embedded database, for this test."""
        from jobrelay.testing.runner import run_jobs

        async with run_jobs(jobrelay_app) as runner:
            yield runner

    @pytest_asyncio.fixture
    async def jobrelay_enqueued(jobrelay_app: Any) -> AsyncIterator[Runner]:
        """``enqueued(jobrelay_app)``: what the test's code enqueues, recorded, never run."""
        from jobrelay.testing.runner import enqueued

        async with enqueued(jobrelay_app) as runner:
            yield runner

else:  # pragma: no cover

    @pytest.fixture
    def jobrelay_runner() -> None:
        raise pytest.UsageError("jobrelay_runner is an async fixture: pip install pytest-asyncio")

    @pytest.fixture
    def jobrelay_enqueued() -> None:
        raise pytest.UsageError("jobrelay_enqueued is an async fixture: pip install pytest-asyncio")
