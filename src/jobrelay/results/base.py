"""The results port: write a result under a stable key, atomically, and read it back.

The key is chosen by the operation from the job id alone, so every attempt of a job writes
to the same place; "atomically" means a reader sees either no object or the whole one,
never a partial file, so a worker killed mid-write leaves nothing behind that looks done.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class StoredResult:
    key: str
    size: int
    sha256: str


def attempt_key(key: str, attempt: int | None) -> str:
    """Where attempt ``attempt`` of a job stores the result meant for ``key``, beside it:
    ``exports/acme/<id>.csv`` -> ``exports/acme/<id>.attempt-2.csv`` (the extension kept,
    so the content type is the same). Each claim has its own attempt number, so no two
    attempts ever write, or delete, the same object."""
    tag = f"attempt-{attempt}" if attempt is not None else f"staged-{uuid.uuid4().hex[:12]}"
    folder, slash, name = key.rpartition("/")
    stem, dot, extension = name.rpartition(".")
    if not dot or not stem:  # no extension (or a dot file): the tag goes at the end
        return f"{key}.{tag}"
    return f"{folder}{slash}{stem}.{tag}.{extension}"


class ResultWriter(Protocol):
    async def write(self, chunk: bytes) -> None: ...


class ResultStore(Protocol):
    def writer(
        self, key: str, *, staged: bool = False, attempt: int | None = None
    ) -> ResultSession:
        """A session writing ``key``. ``staged``: the result of attempt ``attempt``, which
        must not become the job's result unless that attempt's completion wins.

        A store that makes a result visible locally (``file://``: a rename) stages the bytes
        invisibly and ``publish()`` makes them the object at ``key``, inside the fenced
        completion. A store that would need a network round trip for that (``s3://``)
        stores the bytes whole at a key of the attempt's own (``attempt_key``) on a clean
        exit, BEFORE the completion; ``publish()`` has nothing left to do, and the
        completion records ``result.key`` (that key) as the job's ``resultKey``: no network
        I/O is ever made while the job's row is locked. ``discard()`` drops what a losing
        attempt staged (deletes its upload)."""
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
