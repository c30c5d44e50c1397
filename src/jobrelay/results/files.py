"""Results on the local file system: ``file://DIR`` keeps key ``a/b.csv`` at ``DIR/a/b.csv``.

A result is written to a unique temporary name in the same directory, flushed and fsynced,
then renamed over the final name. Rename within a directory is atomic on POSIX, so a reader
never sees half a file, and a retry that writes the same key simply replaces it. A staged
session (the worker's) stops before the rename; the worker renames inside the fenced
completion, so only the attempt that holds the claim can ever replace the object.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import os
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import IO
from urllib.parse import unquote, urlsplit

from jobrelay.errors import ConfigError, TransientError
from jobrelay.results.base import ResultWriter, StoredResult

_CHUNK = 64 * 1024  # read size
# Written to the file once this much is buffered: each write is a hop to a worker thread
# (~0.2 ms here), so a 60 MB export in 64 KiB writes spent more in hops than in the disk.
_WRITE_BUFFER = 1024 * 1024
# A temp file untouched this long belongs to a writer that died (exports write continuously).
STALE_TEMP_SECONDS = 600
SWEEP_EVERY_SECONDS = 60.0  # a directory's temp files are looked over at most this often
# Exports hold an account's ledger: readable by the service's own user only, whatever the
# umask (a shared host's other users, a backup agent running as someone else).
FILE_MODE = 0o600
DIR_MODE = 0o700


def path_from_url(url: str) -> Path:
    parts = urlsplit(url)
    if parts.scheme != "file":
        raise ConfigError("JOBRELAY_RESULTS_URL", f"expected file://PATH, got {url!r}")
    # file://./var/exports (relative) and file:///abs/path are both accepted.
    return Path(unquote(parts.netloc + parts.path))


class DirectorySyncs:
    """The ``fsync`` of a directory that makes its renames durable, shared by every rename
    made in it before that ``fsync`` starts: a batch's completions publish side by side
    (``storage.outcomes``), so a batch costs one ``fsync`` and one hop to a thread per
    directory, not one per file. A rename's ``publish`` returns only once an ``fsync`` that
    started after it has ended, as when each made its own.

    The same hop removes dead writers' temp files from the directory, at most once every
    ``SWEEP_EVERY_SECONDS`` (each publish used to list the directory for its own key's)."""

    def __init__(self) -> None:
        self._next: dict[Path, asyncio.Future[None]] = {}
        self._swept: dict[Path, float] = {}

    async def synced(self, directory: Path) -> None:
        """After a rename in ``directory``: until an ``fsync`` of it started since has ended."""
        future = self._next.get(directory)
        if future is None:
            loop = asyncio.get_running_loop()
            future = loop.create_future()
            self._next[directory] = future
            # Started once the renames already scheduled in this turn of the loop (the
            # batch's other publishes) have joined it.
            loop.call_soon(self._start, directory, future)
        await asyncio.shield(future)

    def _start(self, directory: Path, future: asyncio.Future[None]) -> None:
        del self._next[directory]  # a rename from now on waits for the next fsync
        now = time.monotonic()
        sweep = now >= self._swept.get(directory, 0.0)
        if sweep:
            self._swept[directory] = now + SWEEP_EVERY_SECONDS
        task = asyncio.ensure_future(asyncio.to_thread(_sync_dir, directory, sweep))

        def done(task: asyncio.Future[None]) -> None:
            if future.cancelled():
                return
            exc = task.exception()
            if exc is not None:
                future.set_exception(exc)
            else:
                future.set_result(None)

        task.add_done_callback(done)


class FileResults:
    def __init__(self, url: str) -> None:
        self.root = path_from_url(url)
        self._syncs = DirectorySyncs()

    def path_for(self, key: str) -> Path:
        path = (self.root / key).resolve()
        if not path.is_relative_to(self.root.resolve()):
            raise ValueError(f"result key escapes the results directory: {key!r}")
        return path

    def writer(self, key: str, *, staged: bool = False, attempt: int | None = None) -> _FileSession:
        # A rename is local and atomic: staged bytes stay at ``key``, published in the
        # completion (no network I/O under the job's lock, whatever the attempt).
        return _FileSession(key, self.path_for(key), self._syncs, staged=staged)

    async def exists(self, key: str) -> bool:
        return await asyncio.to_thread(self.path_for(key).is_file)

    async def delete(self, key: str) -> None:
        path = self.path_for(key)
        try:
            await asyncio.to_thread(path.unlink, missing_ok=True)
        except OSError as exc:
            raise TransientError(f"could not delete result {path}: {exc}") from exc

    async def read(self, key: str) -> AsyncIterator[bytes]:
        handle = await asyncio.to_thread(self.path_for(key).open, "rb")
        try:
            while chunk := await asyncio.to_thread(handle.read, _CHUNK):
                yield chunk
        finally:
            handle.close()

    def describe(self, key: str) -> str:
        return str(self.path_for(key))

    async def presign(self, key: str, seconds: int, *, filename: str | None = None) -> str | None:
        return None  # a path on this machine is no URL for a client: the API streams it

    async def aclose(self) -> None:
        return None


class _FileWriter:
    def __init__(self, handle: IO[bytes]) -> None:
        self._handle = handle
        self._buffer = bytearray()
        self.size = 0
        self.digest = hashlib.sha256()

    async def write(self, chunk: bytes) -> None:
        self.digest.update(chunk)
        self.size += len(chunk)
        self._buffer += chunk
        if len(self._buffer) >= _WRITE_BUFFER:
            await self.flush()

    async def flush(self) -> None:
        if self._buffer:
            data, self._buffer = bytes(self._buffer), bytearray()
            await asyncio.to_thread(self._handle.write, data)


class _FileSession:
    def __init__(
        self, key: str, path: Path, syncs: DirectorySyncs, *, staged: bool = False
    ) -> None:
        self.key = key
        self.path = path
        self._syncs = syncs
        # Unique per session, so attempts of one job never write into each other's bytes.
        self.temp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        self._staged = staged
        self._pending = False  # staged bytes waiting for publish()
        self._writer: _FileWriter | None = None
        self._result: StoredResult | None = None

    async def __aenter__(self) -> ResultWriter:
        try:
            await asyncio.to_thread(make_private_dirs, self.path.parent)
            opening = asyncio.ensure_future(asyncio.to_thread(_create_private, self.temp))
            try:
                handle = await asyncio.shield(opening)
            except asyncio.CancelledError:
                # Stopped while the thread opens it (a lost lease, a shutdown): the thread
                # still does, so what it opens is closed and removed once it has (CI saw
                # such a handle left to the garbage collector, with its temp file).
                opening.add_done_callback(functools.partial(_abandon, self.temp))
                raise
        except OSError as exc:
            raise TransientError(f"cannot open result file: {exc}") from exc
        self._writer = _FileWriter(handle)
        return self._writer

    async def __aexit__(self, exc_type: object, exc: object, tb: object) -> None:
        writer = self._writer
        assert writer is not None
        handle = writer._handle
        try:
            if exc_type is None:
                await writer.flush()
                await asyncio.to_thread(_sync_and_close, handle)
                self._result = StoredResult(self.key, writer.size, writer.digest.hexdigest())
                self._pending = True
                if not self._staged:
                    await self.publish()
            else:
                handle.close()
                self.temp.unlink(missing_ok=True)
        except BaseException as err:  # a cancel mid-flush too: never leave the temp file
            handle.close()
            self.temp.unlink(missing_ok=True)
            if isinstance(err, OSError):
                raise TransientError(f"cannot save result file: {err}") from err
            raise

    async def publish(self) -> None:
        if not self._pending:
            return
        self._pending = False
        try:
            # In the event loop's own thread, not a worker thread: a cancelled caller (a
            # completion rolled back) can then never see the rename land after it gave up.
            os.replace(self.temp, self.path)
        except OSError as err:
            self.temp.unlink(missing_ok=True)
            raise TransientError(f"cannot save result file: {err}") from err
        try:
            await self._syncs.synced(self.path.parent)
        except OSError as err:
            raise TransientError(f"cannot save result file: {err}") from err

    async def discard(self) -> None:
        if self._pending:
            self._pending = False
            await asyncio.to_thread(self.temp.unlink, True)

    @property
    def result(self) -> StoredResult:
        if self._result is None:
            raise RuntimeError("result not committed")
        return self._result


def make_private_dirs(path: Path) -> None:
    """``mkdir -p`` whose every created directory is ``DIR_MODE``: ``Path.mkdir`` gives the
    parents it creates the default mode, whatever ``mode`` says. Existing ones are left."""
    missing: list[Path] = []
    while not path.is_dir():
        missing.append(path)
        path = path.parent
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):  # another writer made it meanwhile
            directory.mkdir(mode=DIR_MODE)


def _create_private(path: Path) -> IO[bytes]:
    """A new file (never an existing one), created ``FILE_MODE`` from the first byte."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    return os.fdopen(fd, "wb")


def _abandon(temp: Path, opening: asyncio.Future[IO[bytes]]) -> None:
    """Close and remove a temp file opened for a writer that was stopped meanwhile."""
    if opening.cancelled() or opening.exception() is not None:
        return
    opening.result().close()
    with contextlib.suppress(OSError):
        temp.unlink()


def _sync_and_close(handle: IO[bytes]) -> None:
    handle.flush()
    os.fsync(handle.fileno())
    handle.close()


def _sync_dir(path: Path, sweep: bool) -> None:
    """Make the renames themselves durable, not only the files' bytes; ``sweep``: and
    remove the temp files of writers that died mid-write.

    Only old ones: a younger temp file may belong to a worker that is still writing (a
    lease takeover), and deleting it would waste that worker's attempt."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    if not sweep:
        return
    cutoff = time.time() - STALE_TEMP_SECONDS
    with contextlib.suppress(OSError), os.scandir(path) as entries:
        for entry in entries:
            if entry.name.startswith(".") and entry.name.endswith(".tmp"):
                with contextlib.suppress(OSError):
                    if entry.stat(follow_symlinks=False).st_mtime < cutoff:
                        os.unlink(entry.path)
