"""An attempt that lost discards what it staged; a delete that fails is logged, naming the
key (issue 34): the object is left behind, so an operator can find it and remove it."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest

from jobrelay.results.base import StoredResult
from jobrelay.results.staging import StagingResults


class _Session:
    def __init__(self, key: str) -> None:
        self._key = key

    async def publish(self) -> None:
        pass

    async def discard(self) -> None:
        raise OSError("the bucket refused the delete")

    @property
    def result(self) -> StoredResult:
        return StoredResult(key=self._key + ".attempt-2", size=3, sha256="")


class _Store:
    def writer(self, key: str, *, staged: bool = True, attempt: int | None = None) -> Any:
        return _Session(key)

    def read(self, key: str) -> AsyncIterator[bytes]:  # pragma: no cover - not used
        raise NotImplementedError


async def test_a_discard_that_fails_is_logged_naming_the_key(
    caplog: pytest.LogCaptureFixture,
) -> None:
    staging = StagingResults(_Store(), attempt=2)  # type: ignore[arg-type]
    staging.writer("exports/j")
    with caplog.at_level(logging.WARNING, logger="jobrelay"):
        await staging.discard(lost=True)  # still best effort: it does not raise
    failed = [r for r in caplog.records if getattr(r, "event", None) == "result_discard_failed"]
    assert len(failed) == 1
    assert failed[0].levelno == logging.WARNING
    assert "exports/j.attempt-2" in failed[0].getMessage()
    assert getattr(failed[0], "key", None) == "exports/j.attempt-2"
