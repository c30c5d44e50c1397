"""The results port: write a result under a stable key, atomically, and read it back.

The key is chosen by the operation from the job id alone, so every attempt of a job writes
to the same place; "atomically" means a reader sees either no object or the whole one,
never a partial file, so a worker killed mid-write leaves nothing behind that looks done.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class StoredResult:
    key: str
    size: int
    sha256: str


class ResultWriter(Protocol):
    async def write(self, chunk: bytes) -> None: ...


class ResultStore(Protocol):
    def writer(self, key: str, *, staged: bool = False) -> ResultSession:
        """A session writing ``key``. ``staged``: a clean exit only stages the bytes (durably,
        invisibly); ``publish()`` makes them the object at ``key``, ``discard()`` drops them.
        The worker stages every result and publishes it inside the fenced completion."""
        ...

    async def exists(self, key: str) -> bool: ...

    async def delete(self, key: str) -> None:
        """Remove the object at ``key`` (retention prunes it with its job). Idempotent: an
        object that is already gone is not an error; a store that cannot be reached raises
        ``TransientError`` and the caller keeps the job row, to try again later."""
        ...

    def read(self, key: str) -> AsyncIterator[bytes]: ...

    def describe(self, key: str) -> str:
        """Where a person finds the result (a path or URL), for CLI output."""
        ...

    async def presign(self, key: str, seconds: int, *, filename: str | None = None) -> str | None:
        """A URL that lets its bearer GET the result for ``seconds``, or None when this store
        has no such URLs and the API must stream the bytes itself (``file://``).

        Only ever called after the caller checked that the requester may see the job.
        """
        ...

    async def aclose(self) -> None:
        """Release connections; the runtime calls it once, on shutdown."""
        ...


class ResultSession(Protocol):
    """``async with store.writer(key) as w: await w.write(...)``; committed on clean exit
    (or, when staged, by ``publish()``)."""

    async def __aenter__(self) -> ResultWriter: ...

    async def __aexit__(self, exc_type: object, exc: object, tb: object) -> None: ...

    async def publish(self) -> None:
        """Make a staged result the object at its key (a no-op once published)."""
        ...

    async def discard(self) -> None:
        """Drop a staged result that must never become visible (best effort)."""
        ...

    @property
    def result(self) -> StoredResult: ...
