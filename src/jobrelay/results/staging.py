"""The results an attempt writes, held back until its claim is proven to still hold.

An operation writes its result through ``ctx.results`` as usual. Here every session is
*staged* (``ResultStore.writer``), one of two ways, and neither does network I/O while the
job's row is locked:

- ``file://``: a clean exit leaves the bytes durable but invisible (a temp file); the worker
  publishes them (a local rename) inside the fenced completion of the attempt
  (``Store.complete(publish=...)``): the guarded UPDATE that proves the claim holds also
  holds the job's row lock until the commit, so an attempt whose lease was taken over can
  never replace the object the winning attempt committed;
- ``s3://``: a clean exit uploads the bytes whole under a key of the attempt's own
  (``base.attempt_key``), before the completion; the completion records that key as the
  job's ``resultKey`` (``recorded_key``), so only the winning attempt's upload is ever named.

An attempt that lost, failed or was cancelled discards what it staged (deletes its upload).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from jobrelay.results.base import ResultSession, ResultStore

log = logging.getLogger("jobrelay.results")


def _stored_key(session: ResultSession) -> str | None:
    """Where a session stored its bytes, if it wrote them whole."""
    try:
        return session.result.key
    except RuntimeError:  # never written whole
        return None


class StagingResults:
    """A ``ResultStore`` for one attempt: writers are staged and remembered."""

    def __init__(self, inner: ResultStore, attempt: int | None = None) -> None:
        self._inner = inner
        self._attempt = attempt
        self._sessions: list[ResultSession] = []
        self._stored: dict[str, ResultSession] = {}  # the key asked for -> its session
        self._named = False  # a completion that may have committed names our results

    def writer(self, key: str, *, staged: bool = True, attempt: int | None = None) -> ResultSession:
        session = self._inner.writer(key, staged=True, attempt=self._attempt)
        self._sessions.append(session)
        self._stored[key] = session
        return session

    def recorded_key(self, key: str | None) -> str | None:
        """The ``resultKey`` to record for a result returned as ``key``: where this attempt's
        writer of ``key`` stored it (its own key on S3), else ``key`` as it is."""
        session = self._stored.get(key) if key is not None else None
        if session is None:
            return key
        try:
            return session.result.key
        except RuntimeError:  # never written whole: nothing of ours is at any key
            return key

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
        """Make every staged result visible; called under the completion's row lock, once
        its guarded UPDATE has won (a local rename at most: S3 uploads are done by now)."""
        self._named = True
        for session in self._sessions:
            await session.publish()

    async def discard(self, *, lost: bool = False) -> None:
        """Drop what this attempt staged; it must never be served.

        Once a completion has named it (``publish`` ran in one whose commit may have landed
        unseen), only an attempt known to have lost (``lost``: its fenced write lost, after
        its own earlier commit was ruled out) deletes it: a stop in between leaves it, since
        a result a committed job names is never deleted."""
        if self._named and not lost:
            return
        for session in self._sessions:
            try:
                await session.discard()
            except Exception as exc:  # best effort, but never silent: the object is left
                key = _stored_key(session) or next(
                    (asked for asked, each in self._stored.items() if each is session), "?"
                )
                log.warning(
                    "staged result %s of a lost attempt could not be deleted: %s (it is never "
                    "served; delete it by hand)",
                    key,
                    exc,
                    extra={"event": "result_discard_failed", "key": key},
                )
