"""The results an attempt writes, held back until its claim is proven to still hold.

An operation writes its result through ``ctx.results`` as usual. Here every session is
*staged*: a clean exit leaves the bytes durable but invisible (a temp file, an incomplete
multipart upload). The worker then publishes them inside the fenced completion of the
attempt (``Store.complete(publish=...)``): the guarded UPDATE that proves the claim holds
also holds the job's row lock until the commit, so an attempt whose lease was taken over
can never replace the object the winning attempt committed. An attempt that lost, failed or
was cancelled discards what it staged.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from jobrelay.results.base import ResultSession, ResultStore


class StagingResults:
    """A ``ResultStore`` for one attempt: writers are staged and remembered."""

    def __init__(self, inner: ResultStore) -> None:
        self._inner = inner
        self._sessions: list[ResultSession] = []

    def writer(self, key: str, *, staged: bool = True) -> ResultSession:
        session = self._inner.writer(key, staged=True)
        self._sessions.append(session)
        return session

    async def exists(self, key: str) -> bool:
        return await self._inner.exists(key)

    async def delete(self, key: str) -> None:
        await self._inner.delete(key)

    def read(self, key: str) -> AsyncIterator[bytes]:
        return self._inner.read(key)

    def describe(self, key: str) -> str:
        return self._inner.describe(key)

    async def presign(self, key: str, seconds: int, *, filename: str | None = None) -> str | None:
        return await self._inner.presign(key, seconds, filename=filename)

    async def aclose(self) -> None:
        return None  # the runtime owns the real store

    @property
    def staged(self) -> bool:
        """Whether this attempt opened a writer (a job with no file completes in one statement)."""
        return bool(self._sessions)

    async def publish(self) -> None:
        """Make every staged result visible; called under the completion's row lock."""
        for session in self._sessions:
            await session.publish()

    async def discard(self) -> None:
        """Drop what this attempt staged; it must never be served."""
        for session in self._sessions:
            with contextlib.suppress(Exception):
                await session.discard()
